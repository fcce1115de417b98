"""A mutating call that fails part-way (here: a simulated out-of-memory while writing the value
buffers, after the key buffers were written) leaves the cache exactly as it was (issue 15)."""

from __future__ import annotations

import mlx.core as mx
import palu_mlx.cache
import palu_mlx.calibrated
import palu_mlx.naive
import pytest
from palu_reliability_helpers import build, kv, snapshot

MODULES = {"naive": palu_mlx.naive, "palu-fitted": palu_mlx.cache, "calibrated": palu_mlx.calibrated}


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
        pytest.param(
            "palu-fitted",
            marks=pytest.mark.xfail(
                strict=True,
                reason="PaluKVCache.update_and_fetch assigns self._key_codes before the value codes are "
                "written; a failure there leaves the grown key buffer (nbytes changes). Needs both "
                "_append_codes results in locals, then one assignment (cache.py, not this task's file)",
            ),
        ),
        pytest.param(
            "calibrated",
            marks=pytest.mark.xfail(
                strict=True,
                reason="CalibratedKVCache.update_and_fetch assigns self._key_codes before writing the value "
                "codes (same fix as PaluKVCache; calibrated.py's update path is not this task's)",
            ),
        ),
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
