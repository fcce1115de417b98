"""Bad input to kvspec's helpers and loaders gets a kvspec error that says what was wrong."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError
from kvspec.synthetic import gaussian, outlier_keys, planted_lowrank, random_walk
from kvspec.vectors import (
    ARRAYS_NAME,
    DATA_DIR,
    MANIFEST_NAME,
    is_representable,
    load_vectors,
    round_to_dtype,
)


@pytest.mark.parametrize("array", [None, "text", [["a", "b"]], {"k": 1}])
def test_round_to_dtype_refuses_what_is_not_numbers(array):
    with pytest.raises(KVDtypeError, match="round_to_dtype: array must be .* real numbers"):
        round_to_dtype(array, "float16")
    with pytest.raises(KVDtypeError, match="is_representable: array must be"):
        is_representable(array, "float16")


def test_round_to_dtype_still_rounds_numbers_and_names_a_bad_dtype():
    assert round_to_dtype([1.0, 2.5], "float32").tolist() == [1.0, 2.5]
    assert round_to_dtype(np.arange(3), "bfloat16").dtype == np.float32
    with pytest.raises(KVConfigError, match=r"dtype must be one of .*got 'int8'"):
        round_to_dtype(np.zeros(2), "int8")


@pytest.mark.parametrize("generator", [gaussian, planted_lowrank, random_walk, outlier_keys])
@pytest.mark.parametrize("shape", [(2, 3, 4), (1, 2, 3, 4, 5), (1, 0, 4, 8), (1, 2, 4.0, 8), "1,2,4,8", None])
def test_generators_refuse_a_shape_that_is_not_b_h_s_d(generator, shape):
    with pytest.raises(KVShapeError, match=r"shape must be \(B, H, S, D\): four integers >= 1"):
        generator(shape, 0)


def test_generators_accept_b_h_s_d():
    keys, values = gaussian((1, 2, 3, 8), 0)
    assert keys.shape == values.shape == (1, 2, 3, 8)


def _copy_data(tmp_path):
    shutil.copy(DATA_DIR / MANIFEST_NAME, tmp_path / MANIFEST_NAME)
    with np.load(DATA_DIR / ARRAYS_NAME) as npz:
        return {name: npz[name] for name in npz.files}


def test_a_float64_array_in_the_npz_is_refused_not_cast(tmp_path):
    arrays = _copy_data(tmp_path)
    first = sorted(arrays)[0]
    arrays[first] = arrays[first].astype(np.float64)
    np.savez(tmp_path / ARRAYS_NAME, **arrays)
    with pytest.raises(KVDataError, match=rf"{first} is float64; the format stores float32 arrays only"):
        load_vectors(data_dir=tmp_path)


@pytest.mark.parametrize("keep", [0, 2, 1000])
def test_a_truncated_npz_is_a_data_error_naming_the_file(tmp_path, keep):
    _copy_data(tmp_path)
    data = (DATA_DIR / ARRAYS_NAME).read_bytes()
    (tmp_path / ARRAYS_NAME).write_bytes(data[:keep])
    with pytest.raises(KVDataError, match=rf"{ARRAYS_NAME}: cannot be read as the vectors' arrays"):
        load_vectors(data_dir=tmp_path)
