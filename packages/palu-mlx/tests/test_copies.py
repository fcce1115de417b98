"""Copies of a cache (deepcopy, pickle, state / from_state) are faithful and independent, and no
array a cache hands out can change it."""

from __future__ import annotations

import copy
import pickle

import mlx.core as mx
import numpy as np
import pytest
from cache_snapshots import KINDS, build, kv, snapshot
from mlx_lm.models.cache import LRUPromptCache

COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda c: pickle.loads(pickle.dumps(c)),
    "from_state": lambda c: type(c).from_state(c.state, c.meta_state),
}


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_copy_is_faithful_and_independent(kind, how, dtype):
    original = build(kind, dtype)
    before = snapshot(original)
    twin = COPIES[how](original)
    assert type(twin) is type(original)
    assert snapshot(twin) == before
    # each goes on alone: the other does not move
    twin.update_and_fetch(*kv(3, 5, dtype))
    assert snapshot(original) == before
    after_twin = snapshot(twin)
    original.update_and_fetch(*kv(2, 6, dtype))
    assert snapshot(twin) == after_twin


@pytest.mark.parametrize("kind", ["palu-fitted", "naive", "calibrated"])
def test_trimmed_copy_does_not_write_into_the_original(kind):
    # after a trim the next update writes into the held buffer in place: a copy must not share that
    original = build(kind)
    before = snapshot(original)
    twin = copy.deepcopy(original)
    twin.trim(3)
    twin.update_and_fetch(*kv(3, 8))
    assert snapshot(original) == before


def test_mlx_lm_lru_prompt_cache_hands_out_copies():
    # mlx-lm's server keeps prompt caches in an LRUPromptCache, which deep-copies on every fetch
    lru = LRUPromptCache(max_size=4)
    caches = [build("palu-fitted"), build("naive")]
    before = [snapshot(c) for c in caches]
    lru.insert_cache("model", list(range(12)), caches)
    fetched, rest = lru.fetch_nearest_cache("model", list(range(12)) + [40, 41])
    assert rest == [40, 41] and [snapshot(c) for c in fetched] == before
    for c in fetched:
        c.update_and_fetch(*kv(2, 9))
    # a shorter prompt trims the copy of a longer entry: the stored entry stays whole
    shorter, _ = lru.fetch_nearest_cache("model", list(range(6)) + [50])
    assert shorter[0].offset < 12
    assert [snapshot(c) for c in caches] == before


@pytest.mark.parametrize("kind", sorted(k for k in KINDS if not k.endswith("empty")))
def test_writing_into_state_arrays_changes_nothing(kind):
    cache = build(kind)
    before = snapshot(cache)
    state = cache.state
    for arr in state.values():
        arr[...] = 0  # an mx write into the returned array
    state = cache.state
    for arr in state.values():
        view = np.asarray(arr)  # a numpy view of the returned array's memory
        assert view.flags.writeable
        view[...] = 7
    assert snapshot(cache) == before


@pytest.mark.parametrize("kind", sorted(k for k in KINDS if not k.endswith("empty")))
def test_from_state_does_not_keep_the_callers_arrays(kind):
    state, meta = build(kind).state, build(kind).meta_state
    restored = type(build(kind)).from_state(state, meta)
    before = snapshot(restored)
    for arr in state.values():
        np.asarray(arr)[...] = 3
    assert snapshot(restored) == before
