"""The numpy reference cache: the behaviours the conformance checks do not pin down."""

from __future__ import annotations

import numpy as np
import pytest
from kvspec import KVConfigError, KVDtypeError, KVShapeError, KVTrimError, KVValueError
from kvspec.conformance import run_conformance
from kvspec.reference import NumpyReferenceCache, ReferenceAdapter, ReferenceConfig


def _kv(s, d=8, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, 2, s, d)).astype(dtype), rng.standard_normal((1, 2, s, d)).astype(dtype)


def test_buffers_grow_in_steps_and_nbytes_counts_capacity():
    cache = NumpyReferenceCache(ReferenceConfig(step=4))
    assert cache.nbytes == 0 and cache.empty()
    cache.update_and_fetch(*_kv(3))
    assert cache.buffers[0].shape == (1, 2, 4, 8)
    assert cache.nbytes == 2 * 1 * 2 * 4 * 8 * 4 and cache.raw_nbytes == 2 * 1 * 2 * 3 * 8 * 4
    cache.update_and_fetch(*_kv(2))
    assert cache.buffers[0].shape == (1, 2, 8, 8)


def test_outputs_are_copies():
    cache = NumpyReferenceCache()
    k, v = _kv(3)
    out_k, _ = cache.update_and_fetch(k, v)
    out_k[...] = 0
    again, _ = cache.update_and_fetch(*_kv(1, seed=1))
    assert np.array_equal(again[:, :, :3], k)


def test_rejections():
    cache = NumpyReferenceCache()
    with pytest.raises(KVDtypeError, match="numpy.ndarray"):
        cache.update_and_fetch([[1.0]], [[1.0]])
    with pytest.raises(KVDtypeError, match="float16.*float32.*got float64"):
        cache.update_and_fetch(*_kv(2, dtype=np.float64))
    cache.update_and_fetch(*_kv(2))
    with pytest.raises(KVDtypeError, match="fixed by the first update"):
        cache.update_and_fetch(*_kv(2, dtype=np.float16))
    with pytest.raises(KVShapeError):
        cache.update_and_fetch(*_kv(2, d=4))
    k, v = _kv(2)
    k[0, 0, 0, 0] = np.inf
    with pytest.raises(KVValueError, match="1 NaN or infinite"):
        cache.update_and_fetch(k, v)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(KVTrimError, match="int n >= 0"):
            cache.trim(bad)
    assert cache.offset == 2


def test_nonfinite_accepted_when_configured():
    cache = NumpyReferenceCache(ReferenceConfig(reject_nonfinite=False))
    k, v = _kv(2)
    k[0, 0, 0, 0] = np.nan
    out, _ = cache.update_and_fetch(k, v)
    assert np.isnan(out[0, 0, 0, 0])


def test_config_and_restore_validation():
    for step in (0, -1, 2.0, True):
        with pytest.raises(KVConfigError, match="step must be an int >= 1"):
            ReferenceConfig(step=step)
    cache = NumpyReferenceCache()
    cache.update_and_fetch(*_kv(3))
    with pytest.raises(KVConfigError, match="does not match state lengths"):
        NumpyReferenceCache.from_state(cache.state, ("2", "64", "1"))
    empty = NumpyReferenceCache.from_state((), NumpyReferenceCache().meta_state)
    assert empty.empty() and empty.offset == 0


def test_reference_adapter_passes_every_check():
    results = list(run_conformance(ReferenceAdapter()))
    assert len(results) > 50
    assert [r for r in results if r[1] is not None] == []


@pytest.mark.parametrize(
    "meta", ["521", b"521", ("3", "64"), ("3", "64", "1", "0"), ("3", "64", "2"), ("-1", "64", "1"),
             ("3", "6.5", "1"), (3.0, 64, 1), (True, 64, 1), None],
)  # fmt: skip
def test_from_state_refuses_a_malformed_meta_state(meta):
    cache = NumpyReferenceCache()
    cache.update_and_fetch(*_kv(3))
    with pytest.raises(KVConfigError, match="meta_state"):
        NumpyReferenceCache.from_state(cache.state, meta)
    rebuilt = NumpyReferenceCache.from_state(cache.state, (3, 64, 1))  # ints are fine too
    assert rebuilt.offset == 3


def test_relative_error_refuses_shapes_that_would_broadcast():
    from kvspec.conformance import relative_error

    want = np.ones((1, 2, 4, 8), np.float32)
    assert relative_error(want * 1.5, want) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="must be equal"):
        relative_error(want[:, :, :1], want)
