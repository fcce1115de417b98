"""check_kv_pair, the error classes and StorageStats."""

from __future__ import annotations

import math

import kvspec
import numpy as np
import pytest
from kvspec import (
    KVConfigError,
    KVDtypeError,
    KVShapeError,
    KVTrimError,
    StorageStats,
    check_kv_pair,
    interface,
    trim_count,
)

F32 = np.dtype(np.float32)


def test_valid_pair_returns_dimensions():
    assert check_kv_pair((2, 4, 7, 64), (2, 4, 7, 32), F32, F32) == (2, 4, 7, 64, 32)
    assert check_kv_pair((2, 4, 1, 64), (2, 4, 1, 32), F32, F32, expected=(2, 4, 64, 32)) == (2, 4, 1, 64, 32)


@pytest.mark.parametrize(
    ("keys", "values", "match"),
    [
        ((4, 7, 64), (4, 7, 64), "must be 4-D"),
        ((1, 2, 4, 7, 64), (1, 2, 4, 7, 64), "must be 4-D"),
        ((1, 4, 7, 64), (1, 4, 8, 64), "must agree on B, H and S"),
        ((1, 4, 7, 64), (1, 2, 7, 64), "must agree on B, H and S"),
        ((1, 4, 0, 64), (1, 4, 0, 64), "every dimension must be >= 1"),
    ],
)
def test_bad_shapes_raise_kv_shape_error_naming_the_shapes(keys, values, match):
    with pytest.raises(KVShapeError, match=match) as info:
        check_kv_pair(keys, values, F32, F32)
    assert str(keys) in str(info.value)


def test_changed_dimensions_mid_stream():
    with pytest.raises(
        KVShapeError, match=r"fixed by the first update at \(1, 4, 64, 64\); got \(1, 4, 32, 64\)"
    ):
        check_kv_pair((1, 4, 1, 32), (1, 4, 1, 64), F32, F32, expected=(1, 4, 64, 64))


def test_dtype_mismatch():
    with pytest.raises(KVDtypeError, match="float32.*float16"):
        check_kv_pair((1, 1, 1, 8), (1, 1, 1, 8), F32, np.dtype(np.float16))


#: the builtin each error class also is, so callers that only know the builtins still catch it
BUILTIN = {
    "KVConfigError": ValueError,
    "KVShapeError": ValueError,
    "KVDtypeError": TypeError,
    "KVValueError": ValueError,
    "KVTrimError": ValueError,
    "KVDataError": ValueError,
}


def test_error_hierarchy_lets_builtin_handlers_catch():
    errors = {name for name in interface.__all__ if name.endswith("Error")} - {"KVSpecError"}
    assert errors == set(BUILTIN)  # a new error class is added to BUILTIN, with its builtin
    for name, builtin in BUILTIN.items():
        cls = getattr(interface, name)
        assert issubclass(cls, interface.KVSpecError) and issubclass(cls, builtin)


def test_package_root_exports_the_interface():
    assert set(interface.__all__) <= set(kvspec.__all__)
    for name in kvspec.__all__:
        assert getattr(kvspec, name) is not None
    for name in interface.__all__:
        assert getattr(kvspec, name) is getattr(interface, name)


def test_storage_stats():
    stats = StorageStats(tokens=10, nbytes=500, raw_nbytes=2000, elements=1000)
    assert stats.ratio == 0.25
    assert stats.bits_per_element == 4.0
    empty = StorageStats(tokens=0, nbytes=0, raw_nbytes=0, elements=0)
    assert math.isnan(empty.ratio) and math.isnan(empty.bits_per_element)
    with pytest.raises(AttributeError):
        stats.nbytes = 1  # frozen


def test_trim_count_validates_and_clamps():
    assert trim_count(0, 5) == 0
    assert trim_count(3, 5) == 3
    assert trim_count(9, 5) == 5  # clamped to what is held
    assert trim_count(np.int64(2), 5) == 2
    for bad in (-1, 1.5, True, "2", None):
        with pytest.raises(KVTrimError, match=r"trim\(n=.*\) needs an int n >= 0"):
            trim_count(bad, 5)


# --------------------------------------------------------------------------- bad input to helpers
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(s=10, singles=0, cycle=(0,)), "cycle must be"),
        (dict(s=10, cycle=()), "cycle must be"),
        (dict(s=10, cycle=(2.5,)), "cycle must be"),
        (dict(s=0), "s must be"),
        (dict(s=True), "s must be"),
        (dict(s=10, singles=-1), "singles must be"),
    ],
)
def test_stream_schedule_rejects_what_would_never_finish(kwargs, match):
    from kvspec.conformance import stream_schedule

    with pytest.raises(KVConfigError, match=match):
        stream_schedule(**kwargs)
    assert sum(stream_schedule(10, singles=0, cycle=(1,))) == 10


def test_trim_count_checks_the_offset_too():
    with pytest.raises(KVConfigError, match="offset=-5"):
        trim_count(0, -5)
    assert trim_count(3, 2) == 2


@pytest.mark.parametrize("field", ["tokens", "nbytes", "raw_nbytes", "elements"])
@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_storage_stats_refuses_impossible_sizes(field, bad):
    good = dict(tokens=1, nbytes=2, raw_nbytes=4, elements=2)
    with pytest.raises(KVConfigError, match=field):
        StorageStats(**{**good, field: bad})


def test_vector_files_that_are_missing_or_corrupt_name_the_file(tmp_path):
    from kvspec import KVDataError, load_vectors

    with pytest.raises(KVDataError, match="holds no manifest.json"):
        load_vectors(data_dir=tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(KVDataError, match="manifest.json: not a kvspec manifest"):
        load_vectors(data_dir=bad)
    (bad / "manifest.json").write_text(
        '{"vectors": [{"name": "x", "family": "gaussian", "dtype": "float32"}]}'
    )
    (bad / "vectors.npz").write_bytes(b"not a zip file")
    with pytest.raises(KVDataError, match="vectors.npz: cannot be read"):
        load_vectors(data_dir=bad)


@pytest.mark.parametrize("bad", [2.0, 2.5, True, "2", None])
def test_dimensions_must_be_integers(bad):
    with pytest.raises(KVShapeError, match="must hold integer dimensions"):
        check_kv_pair((1, bad, 4, 8), (1, 2, 4, 8), "float32", "float32")
    with pytest.raises(KVShapeError, match="must hold integer dimensions"):
        check_kv_pair((1, 2, 4, 8), (1, 2, 4, bad), "float32", "float32")
    assert check_kv_pair((np.int64(1), 2, 4, 8), (1, 2, 4, 8), "float32", "float32") == (1, 2, 4, 8, 8)
