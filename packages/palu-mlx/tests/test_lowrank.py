"""Group-head SVD: planted subspaces are recovered, ranks are chosen as documented."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvspec import KVConfigError, KVDtypeError
from palu_helpers import gaussian, planted_lowrank
from palu_mlx import fit_group_projection, project, reconstruct, select_rank
from palu_mlx.kvspec_adapter import PaluAdapter
from palu_mlx.lowrank import group_spectrum


def test_group_svd_recovers_planted_subspace():
    x = planted_lowrank((1, 8, 128, 64), rank=8, seed=1)
    proj = fit_group_projection(x, n_groups=4, rank=8)
    assert proj.basis.shape == (4, 64, 8) and proj.mean.shape == (4, 64)
    x_hat = reconstruct(project(x, proj), proj, mx.float32)
    assert mx.mean((x_hat - x) ** 2).item() < 1e-3


def test_basis_is_orthonormal_and_sorted():
    proj = fit_group_projection(gaussian((2, 4, 50, 32)), n_groups=2, rank=12)
    gram = proj.basis.transpose(0, 2, 1) @ proj.basis
    assert np.allclose(np.array(gram), np.eye(12)[None], atol=1e-5)
    sv = np.array(proj.singular_values)
    assert np.all(np.diff(sv, axis=1) <= 1e-4)


def test_groups_are_contiguous_heads_sharing_one_projection():
    # Heads 0-1 live in one subspace, heads 2-3 in another: two groups fit each exactly at rank 4.
    a = planted_lowrank((1, 2, 64, 32), rank=4, seed=2)
    b = planted_lowrank((1, 2, 64, 32), rank=4, seed=3)
    x = mx.concatenate([a, b], axis=1)
    two = fit_group_projection(x, n_groups=2, rank=4)
    one = fit_group_projection(x, n_groups=1, rank=4)
    err2 = mx.mean((reconstruct(project(x, two), two, mx.float32) - x) ** 2).item()
    err1 = mx.mean((reconstruct(project(x, one), one, mx.float32) - x) ** 2).item()
    assert err2 < 1e-4 < err1


def test_energy_rank_is_min_over_groups_and_in_range():
    sv = np.array([[4.0, 2.0, 1.0, 0.0], [3.0, 3.0, 3.0, 3.0]])
    # group 0: energies 16, 4, 1 (total 21) -> 90% at rank 2; group 1 -> rank 4 at 90%.
    assert select_rank(sv, 0.90) == 2
    assert select_rank(sv, 1.0) == 3
    assert select_rank(np.zeros((2, 8)), 0.9) == 1
    for threshold in (0.05, 0.5, 0.9, 0.99, 1.0):
        proj = fit_group_projection(gaussian((1, 4, 80, 16), seed=4), 2, None, threshold)
        assert 1 <= proj.rank <= 16


def test_energy_rank_finds_planted_rank():
    x = planted_lowrank((1, 4, 100, 32), rank=6, seed=5)
    _, sv, _ = group_spectrum(x, 2)
    assert select_rank(np.array(sv), 0.999) == 6


def test_heads_not_divisible_by_groups_is_a_clear_error():
    with pytest.raises(KVConfigError, match="palu_n_head_groups=3"):
        fit_group_projection(gaussian((1, 4, 8, 16)), n_groups=3, rank=2)


def test_non_numeric_inputs_are_refused_naming_the_argument():
    with pytest.raises(KVConfigError, match="singular_values must be a numeric"):
        select_rank([["a", "b"]], 0.9)
    with pytest.raises(KVDtypeError, match="to_native needs a numeric array; got dict"):
        PaluAdapter().to_native({"a": 1}, "float32")
