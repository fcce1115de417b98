"""The batch form of palu caches (palu_mlx.batch) under mlx-lm's BatchGenerator."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvspec import KVConfigError
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache
from palu_helpers import make_tiny_qwen3
from palu_mlx import KVCacheBuilder, KVCacheConfig, PaluKVCache
from palu_mlx.batch import BatchedLayerCache

# 70-180 tokens: past the fit point (head dim 32) for every row, at different lengths
LENGTHS = (70, 181, 96)


@pytest.fixture(scope="module")
def palu_model():
    model = make_tiny_qwen3(seed=3)
    # no exact newest-token window: on these 70-180-token float32 rows its 32 exact rows would
    # outweigh the codes, and the test checks that every row's cache is smaller than raw
    config = KVCacheConfig(method="palu", head_dim=32, palu_bits=3.0, palu_recent_tokens=0)
    KVCacheBuilder.install(model, config)
    yield model
    KVCacheBuilder.uninstall(model)


def _prompts(vocab: int = 256) -> list[list[int]]:
    return [[int(t) for t in mx.random.randint(0, vocab, (n,), key=mx.random.key(n))] for n in LENGTHS]


def _one_at_a_time(model, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=make_prompt_cache(model))
    return [int(t) for t, _ in steps]


def _batched(model, prompts: list[list[int]], n: int, **kw) -> tuple[dict[int, list[int]], dict[int, list]]:
    gen = BatchGenerator(model, max_tokens=n, **kw)
    uids = gen.insert(prompts)
    tokens, caches = {u: [] for u in uids}, {}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = (r.prompt_cache, r.all_tokens)
    gen.close()
    return [tokens[u] for u in uids], [caches[u] for u in uids]


def test_batched_greedy_tokens_equal_one_request_at_a_time(palu_model):
    """Rows of different lengths (left padding, right-padded prefill in chunks) decode exactly as alone."""
    prompts = _prompts()
    batched, caches = _batched(palu_model, prompts, 6, prefill_step_size=64)
    for prompt, got in zip(prompts, batched, strict=True):
        assert got == _one_at_a_time(palu_model, prompt, 6)
    # each finished row hands back its own compressed palu caches, holding only its tokens
    for prompt, (cache, held_tokens) in zip(prompts, caches, strict=True):
        assert all(isinstance(c, PaluKVCache) and c.fitted for c in cache)
        assert held_tokens[: len(prompt)] == prompt
        assert {c.offset for c in cache} == {len(held_tokens)}
        assert all(c.nbytes < c.raw_nbytes for c in cache)


def test_merge_copies_and_lays_rows_out_left_padded():
    config = KVCacheConfig(method="palu", head_dim=8, palu_bits=3.0)
    short, long = PaluKVCache(config), PaluKVCache(config)
    short.update_and_fetch(mx.ones((1, 2, 3, 8)), mx.ones((1, 2, 3, 8)))
    long.update_and_fetch(mx.full((1, 2, 5, 8), 2.0), mx.full((1, 2, 5, 8), 2.0))
    batch = BatchedLayerCache.merge([short, long])
    assert batch.size() == 5 and batch.offset.tolist() == [3, 5] and batch.left_padding.tolist() == [2, 0]
    keys, values = batch.update_and_fetch(mx.zeros((2, 2, 1, 8)), mx.zeros((2, 2, 1, 8)))
    assert keys.shape == (2, 2, 6, 8)
    assert keys[0, :, :2].abs().max().item() == 0  # the pad columns
    assert mx.array_equal(keys[0, :, 2:5], mx.ones((2, 3, 8))).item()
    assert short.offset == 3 and long.offset == 5  # merge copied: the given caches are unchanged
    row = batch.extract(0)
    assert isinstance(row, PaluKVCache) and row.offset == 4
    batch.filter([0])
    assert batch.size() == 4 and batch.left_padding.tolist() == [0]  # the shared pad column is dropped


def test_mask_matches_mlx_lm_batch_cache():
    from mlx_lm.models.cache import BatchKVCache, KVCache

    config = KVCacheConfig(method="palu", head_dim=8)
    ours, theirs = [], []
    for n in (2, 4):
        c, k = PaluKVCache(config), KVCache()
        x = mx.ones((1, 1, n, 8))
        c.update_and_fetch(x, x)
        k.update_and_fetch(x, x)
        ours.append(c)
        theirs.append(k)
    a, b = BatchedLayerCache.merge(ours), BatchKVCache.merge(theirs)
    assert mx.array_equal(a.make_mask(3), b.make_mask(3)).item()
    assert a.offset.tolist() == b.offset.tolist()


def test_bad_arguments_raise_value_errors():
    with pytest.raises(KVConfigError, match="left_padding"):
        BatchedLayerCache([PaluKVCache(KVCacheConfig(method="palu"))], [0, 1])
    with pytest.raises(KVConfigError, match="at least one"):
        BatchedLayerCache.merge([])
