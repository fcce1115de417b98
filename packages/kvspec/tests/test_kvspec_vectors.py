"""The shipped test vectors: manifest and arrays agree, dtypes are honest, the writer merges."""

from __future__ import annotations

import json

import numpy as np
import pytest
from kvspec import KVDataError
from kvspec.vectors import (
    DATA_DIR,
    DTYPES,
    FAMILIES,
    TestVector,
    _cached,
    add_vectors,
    get_vector,
    is_representable,
    load_vectors,
    round_to_dtype,
    vector_statistics,
    write_vectors,
)

SYNTHETIC_FAMILIES = ("planted_lowrank", "random_walk", "gaussian", "outlier_keys", "edge")


@pytest.fixture(scope="module")
def manifest():
    return json.loads((DATA_DIR / "manifest.json").read_text())["vectors"]


@pytest.fixture(scope="module")
def vectors():
    return load_vectors()


def test_manifest_lists_every_array_and_nothing_else(manifest):
    with np.load(DATA_DIR / "vectors.npz") as npz:
        stored = set(npz.files)
    listed = {f"{e['name']}/{part}" for e in manifest for part in ("keys", "values")}
    assert stored == listed


def test_manifest_matches_arrays(manifest, vectors):
    by_name = {v.name: v for v in vectors}
    assert [e["name"] for e in manifest] == [v.name for v in vectors]
    for entry in manifest:
        vec = by_name[entry["name"]]
        assert entry["family"] in FAMILIES
        assert entry["dtype"] in DTYPES
        assert tuple(entry["shape"]) == vec.shape == vec.keys.shape
        assert tuple(entry["values_shape"]) == vec.values_shape == vec.values.shape
        assert vec.keys.dtype == np.float32 and vec.values.dtype == np.float32
        prov = entry["provenance"]
        assert ("generator" in prov and "seed" in prov) or {"model", "text", "layer"} <= set(prov), prov


def test_statistics_in_manifest_are_measured(manifest, vectors):
    by_name = {v.name: v for v in vectors}
    for entry in manifest:
        vec = by_name[entry["name"]]
        measured = json.loads(json.dumps(vector_statistics(vec.keys, vec.values)))
        # capture_kv.py adds codec statistics of its own to real vectors; every statistic kvspec
        # measures must still be there and equal.
        for tensor, stats in measured.items():
            stored = entry["statistics"][tensor]
            assert {k: stored.get(k) for k in stats} == stats, (entry["name"], tensor)


def test_every_vector_is_representable_in_its_dtype(vectors):
    for vec in vectors:
        assert is_representable(vec.keys, vec.dtype), vec.name
        assert is_representable(vec.values, vec.dtype), vec.name
        assert np.all(np.isfinite(vec.keys)) and np.all(np.isfinite(vec.values))
        if vec.dtype == "float32":
            # a float32 vector must really use float32 precision, not be half data in disguise
            assert not is_representable(vec.keys, "float16"), vec.name
        if vec.dtype == "float16":
            assert not is_representable(vec.keys, "bfloat16"), vec.name


def test_families_and_dtypes_covered(vectors):
    for family in SYNTHETIC_FAMILIES:
        dtypes = {v.dtype for v in vectors if v.family == family}
        assert dtypes == set(DTYPES), (family, dtypes)


def test_edge_sizes_covered(vectors):
    edge = [v.shape for v in vectors if v.family == "edge"]
    assert any(s == 1 for _, _, s, _ in edge), "S=1"
    assert any(all(s % blk for blk in (8, 16, 32, 64)) and s > 64 for _, _, s, _ in edge), (
        "S past a block, ragged"
    )
    assert any(h == 1 for _, h, _, _ in edge), "H=1"
    assert any(b == 2 for b, _, _, _ in edge), "B=2"
    assert any(d == 128 for _, _, _, d in edge), "D=128"


def test_family_statistics_show_the_structure_they_claim(vectors):
    stats = {v.name: v.statistics for v in vectors}
    for name, st in stats.items():
        family = get_vector(name).family
        if family == "planted_lowrank":
            assert st["keys"]["rank99"] <= 8 and st["values"]["rank99"] <= 8, name
        if family == "gaussian":
            assert st["keys"]["rank90"] > 30 and abs(st["keys"]["lag1_autocorr"]) < 0.1, name
        if family == "random_walk":
            assert st["keys"]["lag1_autocorr"] > 0.9, name
        if family == "outlier_keys":
            assert st["keys"]["channel_max_over_median"] > 5, name
            assert st["values"]["channel_max_over_median"] < 1.5, name


def test_data_stays_small():
    total = sum(p.stat().st_size for p in DATA_DIR.iterdir())
    assert total < 4 * 2**20, f"kvspec data is {total} bytes; keep it a few MB"


def test_vectors_are_read_only(vectors):
    with pytest.raises(ValueError):
        vectors[0].keys[0, 0, 0, 0] = 1.0


def test_load_by_family_and_get_vector(vectors):
    gaussian = load_vectors("gaussian")
    assert gaussian and all(v.family == "gaussian" for v in gaussian)
    assert {v.name for v in load_vectors(["gaussian", "edge"])} == {
        v.name for v in vectors if v.family in ("gaussian", "edge")
    }
    assert get_vector("gaussian_f16").dtype == "float16"
    with pytest.raises(KeyError, match="no test vector named 'nope'"):
        get_vector("nope")
    with pytest.raises(ValueError, match="families must be among"):
        load_vectors("gaussan")


def test_round_to_dtype_bfloat16_is_round_to_nearest_even():
    def f32(bits):
        return np.array(bits, dtype=np.uint32).view(np.float32)

    cases = {
        0x3F808000: 0x3F800000,  # exact tie, kept bit even: round down
        0x3F818000: 0x3F820000,  # exact tie, kept bit odd: round up
        0x3F808001: 0x3F810000,  # just above the tie: up
        0x3F807FFF: 0x3F800000,  # just below the tie: down
        0xBF818000: 0xBF820000,  # negative tie, odd: away from zero
        0x7F7FFFFF: 0x7F800000,  # float32 max rounds to bfloat16 infinity, as torch and mlx do
    }
    got = round_to_dtype(f32(list(cases)), "bfloat16").view(np.uint32)
    assert [hex(x) for x in got] == [hex(x) for x in cases.values()]


def test_round_to_dtype_float16_and_checks():
    x = np.array([1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 0.1], dtype=np.float32)
    got = round_to_dtype(x, "float16")
    assert got.dtype == np.float32
    assert got[0] == 1.0 and got[1] == 1.0 + 2.0**-9  # ties to even
    assert is_representable(got, "float16") and not is_representable(x, "float16")
    assert is_representable(round_to_dtype(x, "bfloat16"), "bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        round_to_dtype(x, "int8")


def _vec(name, family="real", dtype="bfloat16", seed=0, s=5):
    rng = np.random.default_rng(seed)
    k = round_to_dtype(rng.standard_normal((1, 2, s, 8)).astype(np.float32), dtype)
    v = round_to_dtype(rng.standard_normal((1, 2, s, 8)).astype(np.float32), dtype)
    prov = (
        {"model": "tiny", "text": "hello", "layer": 0}
        if family == "real"
        else {"generator": "x", "seed": seed}
    )
    return TestVector(name=name, family=family, dtype=dtype, keys=k, values=v, provenance=prov)


def test_add_vectors_merges_replaces_and_validates(tmp_path):
    write_vectors([_vec("a", "gaussian", "float32"), _vec("b", "gaussian", "float16")], tmp_path)
    add_vectors([_vec("real_1", seed=1), _vec("b", "gaussian", "float16", seed=9)], tmp_path)
    got = load_vectors(data_dir=tmp_path)
    assert [v.name for v in got] == ["a", "b", "real_1"]  # b replaced in place, real_1 appended
    assert np.array_equal(got[1].keys, _vec("b", "gaussian", "float16", seed=9).keys)
    assert got[2].provenance == {"model": "tiny", "text": "hello", "layer": 0}
    assert got[2].statistics["keys"]["std"] > 0  # measured on write

    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    not_bf16 = _vec("bad", dtype="float32")
    bad = TestVector("bad", "real", "bfloat16", not_bf16.keys, not_bf16.values, {"model": "m"})
    with pytest.raises(ValueError, match="not representable in bfloat16"):
        add_vectors([bad], tmp_path)
    with pytest.raises(ValueError, match="family must be one of"):
        add_vectors([_vec("c", family="lowrank")], tmp_path)
    with pytest.raises(ValueError, match="must be unique"):
        write_vectors([_vec("a"), _vec("a")], tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written


def test_validate_rejects_malformed_vectors():
    good = _vec("x")
    with pytest.raises(ValueError, match="4-D float32"):
        TestVector("x", "real", "bfloat16", good.keys[0], good.values, good.provenance).validate()
    with pytest.raises(ValueError, match="must agree on B, H, S"):
        TestVector("x", "real", "bfloat16", good.keys, good.values[:, :, :3], good.provenance).validate()
    nan = np.array(good.keys)
    nan[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or infinity"):
        TestVector("x", "real", "bfloat16", nan, good.values, good.provenance).validate()
    with pytest.raises(ValueError, match="provenance"):
        TestVector("x", "real", "bfloat16", good.keys, good.values, {}).validate()


def test_add_vectors_needs_a_folder_named_and_never_defaults_to_the_package_data():
    before = (DATA_DIR / "manifest.json").read_bytes()
    with pytest.raises(TypeError):
        add_vectors([_vec("real_1")])  # no data_dir: the installed package's data is not a default
    with pytest.raises(ValueError, match="data_dir=None must name the vectors folder"):
        add_vectors([_vec("real_1")], None)
    assert (DATA_DIR / "manifest.json").read_bytes() == before


@pytest.mark.parametrize(
    "tamper, match",
    [
        (lambda doc: doc["vectors"][0].update(family="lowrank"), "family must be one of"),
        (lambda doc: doc["vectors"][0].update(dtype="int8"), "dtype must be one of"),
        (lambda doc: doc["vectors"][0].update(dtype="bfloat16"), "not representable in bfloat16"),
        (lambda doc: doc["vectors"][0].update(shape=[1, 2, 3, 4]), "manifest.json says"),
        (lambda doc: doc["vectors"][0].update(provenance={}), "provenance must be a non-empty dict"),
    ],
    ids=["family", "dtype", "dtype-claim", "shape", "provenance"],
)
def test_a_tampered_manifest_is_refused_on_load(tmp_path, tamper, match):
    write_vectors([_vec("a", "gaussian", "float32")], tmp_path)
    path = tmp_path / "manifest.json"
    doc = json.loads(path.read_text())
    tamper(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(KVDataError, match=match):
        load_vectors(data_dir=tmp_path)


def test_tampered_arrays_are_refused_on_load(tmp_path):
    write_vectors([_vec("a", "gaussian", "float32")], tmp_path)
    good = load_vectors(data_dir=tmp_path)[0]
    keys = np.array(good.keys)
    keys[0, 0, 0, 0] = np.inf
    np.savez(tmp_path / "vectors.npz", **{"a/keys": keys, "a/values": np.array(good.values)})
    _cached.cache_clear()
    with pytest.raises(KVDataError, match="NaN or infinity"):
        load_vectors(data_dir=tmp_path)
    np.savez(
        tmp_path / "vectors.npz",
        **{"a/keys": np.array(good.keys)[:, :, :2], "a/values": np.array(good.values)},
    )
    _cached.cache_clear()
    with pytest.raises(KVDataError, match="must agree on B, H, S"):
        load_vectors(data_dir=tmp_path)
