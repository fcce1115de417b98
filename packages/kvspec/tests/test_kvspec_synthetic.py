"""Synthetic vectors regenerate deterministically, equal to the shipped data, keeping real ones."""

from __future__ import annotations

import numpy as np
import pytest
from kvspec import synthetic
from kvspec.vectors import DATA_DIR, TestVector, add_vectors, load_vectors, round_to_dtype


def test_regeneration_is_byte_identical_and_matches_the_shipped_data(tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    assert synthetic.main(["--data-dir", str(first)]) == 0
    assert synthetic.main(["--data-dir", str(second)]) == 0
    for name in ("vectors.npz", "manifest.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name

    shipped = {v.name: v for v in load_vectors() if v.family != "real"}
    fresh = load_vectors(data_dir=first)
    assert [v.name for v in fresh] == [s.name for s in synthetic.SYNTHETIC_SPECS]
    assert set(shipped) == {v.name for v in fresh}
    for vec in fresh:
        old = shipped[vec.name]
        assert np.array_equal(vec.keys, old.keys) and np.array_equal(vec.values, old.values), vec.name
        assert vec.provenance == old.provenance and vec.statistics == old.statistics


def test_check_mode_passes_on_shipped_data_and_fails_on_drift(tmp_path, capsys):
    assert synthetic.main(["--check", "--data-dir", str(DATA_DIR)]) == 0
    assert synthetic.main(["--data-dir", str(tmp_path)]) == 0
    drifted = [v for v in load_vectors(data_dir=tmp_path) if v.name == "gaussian_f32"][0]
    keys = np.array(drifted.keys)
    keys[0, 0, 0, 0] += 1.0
    add_vectors(
        [TestVector(drifted.name, drifted.family, drifted.dtype, keys, drifted.values, drifted.provenance)],
        tmp_path,
    )
    assert synthetic.main(["--check", "--data-dir", str(tmp_path)]) == 1
    assert "gaussian_f32" in capsys.readouterr().out


def test_regeneration_keeps_real_vectors(tmp_path):
    assert synthetic.main(["--data-dir", str(tmp_path)]) == 0
    rng = np.random.default_rng(0)
    k = round_to_dtype(rng.standard_normal((1, 2, 9, 64)).astype(np.float32), "bfloat16")
    real = TestVector("real_x", "real", "bfloat16", k, k.copy(), {"model": "m", "text": "t", "layer": 1})
    add_vectors([real], tmp_path)
    assert synthetic.main(["--data-dir", str(tmp_path)]) == 0
    names = [v.name for v in load_vectors(data_dir=tmp_path)]
    assert names[-1] == "real_x" and len(names) == len(synthetic.SYNTHETIC_SPECS) + 1
    assert np.array_equal(load_vectors("real", data_dir=tmp_path)[0].keys, k)


@pytest.mark.parametrize("name", sorted(synthetic.GENERATORS))
def test_generators_are_seeded(name):
    gen = synthetic.GENERATORS[name]
    shape = (2, 3, 17, 16)
    k1, v1 = gen(shape, 11)
    k2, v2 = gen(shape, 11)
    k3, _ = gen(shape, 12)
    assert k1.shape == shape and v1.shape == shape
    assert np.array_equal(k1, k2) and np.array_equal(v1, v2)
    assert not np.array_equal(k1, k3)


def test_planted_lowrank_has_the_planted_rank():
    keys, _ = synthetic.planted_lowrank((1, 2, 200, 64), 3, rank=6, noise=0.0)
    centred = keys[0, 0] - keys[0, 0].mean(axis=0)
    s = np.linalg.svd(centred, compute_uv=False)
    assert s[5] > 1e-3 * s[0] and s[6] < 1e-9 * s[0]


def test_random_walk_is_autocorrelated():
    keys, _ = synthetic.random_walk((1, 1, 4000, 8), 5, rho=0.9)
    x = keys[0, 0] - keys[0, 0].mean(axis=0)
    lag1 = (x[1:] * x[:-1]).sum(axis=0) / np.sqrt((x[1:] ** 2).sum(axis=0) * (x[:-1] ** 2).sum(axis=0))
    assert np.all(np.abs(lag1 - 0.9) < 0.05)


def test_outlier_keys_have_heavy_channels():
    keys, values = synthetic.outlier_keys((1, 2, 300, 64), 1, n_outliers=3)
    rms = np.sqrt((keys[0, 0] ** 2).mean(axis=0))
    assert np.sum(rms > 5) == 3 and np.sum(rms < 2) == 61
    assert np.sqrt((values**2).mean(axis=2)).max() < 2


def test_generator_arguments_are_checked():
    with pytest.raises(ValueError, match="rank must be in"):
        synthetic.planted_lowrank((1, 1, 4, 8), 0, rank=9)
    with pytest.raises(ValueError, match="rho must be in"):
        synthetic.random_walk((1, 1, 4, 8), 0, rho=1.0)
    with pytest.raises(ValueError, match="n_outliers must be in"):
        synthetic.outlier_keys((1, 1, 4, 8), 0, n_outliers=9)
