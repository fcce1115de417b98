"""capture_kv: the statistics on signals with known answers, and the committed real vectors."""

from __future__ import annotations

import numpy as np
import pytest
from capture_kv import (
    attention_layer_indices,
    capture_kv,
    dct_low_energy_fraction,
    dct_matrix,
    rank_for_energy_per_group,
    resolve_layers,
    var_delta_ratio,
)


def test_dct_matrix_is_orthonormal():
    m = dct_matrix(8)
    np.testing.assert_allclose(m @ m.T, np.eye(8), atol=1e-12)


def test_var_delta_ratio_white_noise_is_two_and_random_walk_is_small():
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((1, 2, 4096, 16))
    assert var_delta_ratio(noise) == pytest.approx(2.0, rel=0.05)
    walk = np.cumsum(noise, axis=2)
    assert var_delta_ratio(walk) < 0.05


def test_dct_energy_of_constant_blocks_is_all_low_frequency():
    rng = np.random.default_rng(1)
    const = np.repeat(rng.standard_normal((1, 1, 4, 1, 8)), 8, axis=3).reshape(1, 1, 32, 8)
    assert dct_low_energy_fraction(const) == pytest.approx(1.0)
    noise = rng.standard_normal((1, 2, 4096, 16))
    assert dct_low_energy_fraction(noise) == pytest.approx(2 / 8, rel=0.05)


def test_rank90_recovers_a_planted_rank_per_group():
    rng = np.random.default_rng(2)
    basis = [np.linalg.qr(rng.standard_normal((64, 64)))[0] for _ in range(2)]
    heads = []
    for h, r in enumerate((3, 3, 10, 10)):  # group 0 rank 3, group 1 rank 10, equal energy per direction
        heads.append(rng.standard_normal((256, r)) @ basis[h // 2][:, :r].T)
    x = np.stack(heads)[None]
    ranks = rank_for_energy_per_group(x, group_size=2)
    assert ranks[0] == 3
    assert 8 <= ranks[1] <= 10
    with pytest.raises(ValueError, match="group_size"):
        rank_for_energy_per_group(x, group_size=3)


def test_resolve_layers():
    available = [1, 3, 5, 7]
    assert resolve_layers("first,mid,last", available) == [1, 5, 7]
    assert resolve_layers("3,last,3", available) == [3, 7]
    with pytest.raises(ValueError, match="holds no K/V"):
        resolve_layers("2", available)


def test_hybrid_models_expose_only_full_attention_layers():
    from types import SimpleNamespace

    hybrid = SimpleNamespace(
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )
    assert attention_layer_indices(hybrid) == [1, 3]
    windowed = SimpleNamespace(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    assert attention_layer_indices(windowed) == [0, 1]


def test_committed_real_vectors_come_from_the_embedded_model(torch_model, hf_tokenizer):
    """Re-capturing the first real vector's layer and tokens reproduces the stored K/V."""
    from kvspec.vectors import load_vectors

    real = load_vectors("real")
    assert len(real) >= 3
    layers = {v.provenance["layer"] for v in real}
    assert {0, torch_model.config.num_hidden_layers - 1} <= layers
    vector = real[0]
    start, stop = vector.provenance["token_range"]
    from corpus import load_corpus

    ids = hf_tokenizer(load_corpus("heldout"), return_tensors="pt").input_ids[:, start:stop]
    keys, values = capture_kv(torch_model, ids, [vector.provenance["layer"]])[vector.provenance["layer"]]
    assert keys.shape == vector.shape
    np.testing.assert_allclose(keys, vector.keys, atol=1e-4, rtol=0)
    np.testing.assert_allclose(values, vector.values, atol=1e-4, rtol=0)
    for label in ("keys", "values"):
        assert {"var_delta_ratio", "dct_low2_energy", "rank90_per_group"} <= set(vector.statistics[label])
