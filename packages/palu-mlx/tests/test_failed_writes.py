"""A mutating call that fails part-way (here: a simulated out-of-memory while writing the value
buffers, after the key buffers were written) leaves the cache exactly as it was."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import palu_mlx.baseline
import palu_mlx.cache
import pytest
from cache_snapshots import build, kv, snapshot
from kvspec import KVConfigError
from palu_mlx import KVCacheConfig, PaluKVCache

MODULES = {"naive": palu_mlx.baseline, "palu-fitted": palu_mlx.cache, "calibrated": palu_mlx.cache}


def fail_after(module, monkeypatch, calls_allowed: int) -> None:
    real = module.write_rows
    count = []

    def write_rows(*args):
        count.append(1)
        if len(count) > calls_allowed:
            raise MemoryError("simulated out of memory")
        return real(*args)

    monkeypatch.setattr(module, "write_rows", write_rows)


def key_fields(cache) -> int:
    """write_rows calls that store one update's keys (the value calls come after them)."""
    return len(
        [
            k
            for k in cache.state
            if k.startswith("key.") and not k.endswith(("basis", "mean", "steps", "singular_values"))
        ]
    )


@pytest.mark.parametrize(
    "kind",
    [
        "naive",
        "palu-fitted",
        "calibrated",
    ],
)
def test_failure_while_writing_values_leaves_the_cache_as_it_was(kind, monkeypatch):
    cache = build(kind)
    cache.update_and_fetch(*kv(256 - cache.offset, 2))  # full buffers: the next update grows them
    before = snapshot(cache)
    fail_after(MODULES[kind], monkeypatch, key_fields(cache))
    with pytest.raises(MemoryError):
        cache.update_and_fetch(*kv(1, 3))
    monkeypatch.undo()
    assert snapshot(cache) == before
    keys, _ = cache.update_and_fetch(*kv(1, 3))  # and it still works
    assert keys.shape[2] == 257 and mx.all(mx.isfinite(keys)).item()


def test_keys_returned_before_the_fit_are_copies():
    cache = PaluKVCache(KVCacheConfig(head_dim=None, palu_n_head_groups=1))
    keys, values = cache.update_and_fetch(*kv(3, 7))
    assert not cache.fitted
    before = np.array(cache.state["exact_keys"])
    np.asarray(keys)[...] = 123.0  # a numpy view of the returned array is writable
    np.asarray(values)[...] = 123.0
    assert np.array_equal(np.array(cache.state["exact_keys"]), before)


def test_palu_cache_refuses_an_allocation_policy_that_is_not_one():
    with pytest.raises(KVConfigError, match="allocation_policy must be a BitAllocationPolicy"):
        PaluKVCache(KVCacheConfig(method="palu", head_dim=64), allocation_policy="water")
