"""Property tests (hypothesis): random call sequences against a plain reference.

* On the lossless tier (png, keep_ratio=1.0, fp64 deltas) every sequence of appends (random chunk
  sizes), crops, trims, reorders (negative indices included), state round trips, deep copies and
  pickles reads back exactly what plain ``torch.cat`` / slicing / indexing hold, and writing into
  what the cache hands out (``read()`` views, ``state``) never changes it.
* ``FlashCodecCache`` (png keep=1.0) follows transformers' ``DynamicCache`` exactly through
  per-layer updates, crops, beam reorders, batch selection and repetition, and copies.
* Random invalid calls, at random points of a valid sequence, raise the library's error (a
  ``KVSpecError`` that is also a ``ValueError`` or ``TypeError``) and leave the cache bit for bit
  as it was; the cache then continues exactly like an untouched twin.

Sizes are small and the example count comes from the profile in ``conftest.py`` ("ci" by default).
Data are multiples of 1/64 (exact zeros included), so the lossless guarantee holds for every
dtype (see ``codecs/png.py`` for its bounds).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import CODECS
from flashcodec import CodecKVCache, PNGCodec
from hypothesis import given
from hypothesis import strategies as st
from kvspec import KVShapeError, KVSpecError
from snapshots import snapshot

transformers = pytest.importorskip("transformers")
from flashcodec.hf import FlashCodecCache  # noqa: E402
from transformers import DynamicCache  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
H, D, DV = 2, 4, 3


def _tokens(seed: int, b: int, s: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, H, s, d, generator=g) * 64).round().div(64).to(dtype)


def _batch_index(raw: list[int], batch: int) -> list[int]:
    """Map raw integers onto valid indices ``-batch..batch-1`` (negatives kept negative)."""
    return [(i % (2 * batch)) - batch for i in raw]


# one operation: (name, integer argument, list argument)
_OPS = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 19), st.just([])),
    st.tuples(st.just("crop"), st.integers(-25, 40), st.just([])),
    st.tuples(st.just("trim"), st.integers(0, 12), st.just([])),
    st.tuples(st.just("reorder"), st.just(0), st.lists(st.integers(0, 50), min_size=1, max_size=3)),
    st.tuples(
        st.sampled_from(["state", "deepcopy", "pickle", "write_view", "write_state", "release"]),
        st.just(0),
        st.just([]),
    ),
)


class _Reference:
    """The plain cache: whole K/V tensors, edited with cat / slicing / indexing."""

    def __init__(self, batch: int):
        self.batch = batch
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def offset(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)

    def keep(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]

    def select(self, idx: list[int]) -> None:
        if self.k is not None:
            self.k, self.v = self.k[idx], self.v[idx]
            self.batch = len(idx)


def _check_equal(cache: CodecKVCache, ref: _Reference) -> None:
    assert cache.offset == ref.offset
    assert cache.nbytes == sum(t.nbytes for t in cache.state)
    if ref.offset:
        k, v = cache.read()
        assert k.dtype == ref.k.dtype and k.shape == ref.k.shape and v.shape == ref.v.shape
        assert torch.equal(k, ref.k) and torch.equal(v, ref.v)


def op_sequences(ops, max_batch: int, max_ops: int):
    """``given`` a dtype, a batch size up to ``max_batch``, a seed and 1 to ``max_ops`` of ``ops``."""
    return given(
        dtype=st.sampled_from(DTYPES),
        batch=st.integers(1, max_batch),
        seed=st.integers(0, 2**31 - 1),
        ops=st.lists(ops, min_size=1, max_size=max_ops),
    )


@op_sequences(_OPS, max_batch=3, max_ops=14)
def test_lossless_cache_equals_plain_tensors(dtype, batch, seed, ops):
    cache = CodecKVCache(codec=PNGCodec(4, keep_ratio=1.0), initial_blocks=1)
    ref = _Reference(batch)
    for step, (op, n, raw) in enumerate(ops):
        if op == "append":
            k = _tokens(seed + step, ref.batch, n, D, dtype)
            v = _tokens(seed + step + 10**6, ref.batch, n, DV, dtype)
            cache.update_and_fetch(k, v)
            ref.append(k, v)
        elif op == "crop":
            cache.crop(n)
            ref.keep(max(0, ref.offset + n) if n < 0 else min(n, ref.offset))
        elif op == "trim":
            assert cache.trim(n) == min(n, ref.offset)
            ref.keep(ref.offset - min(n, ref.offset))
        elif op == "reorder":
            idx = _batch_index(raw, ref.batch)
            if cache.keys is None:  # no batch to gather from yet
                with pytest.raises(KVShapeError, match="never stored a token"):
                    cache.reorder(torch.tensor(idx))
            else:
                cache.reorder(torch.tensor(idx))
                ref.select(idx)
        elif op == "state":
            cache = CodecKVCache.from_state(cache.state, cache.meta_state)
        elif op == "deepcopy":
            twin = copy.deepcopy(cache)
            cache.crop(0)  # the original changing must not reach the copy
            cache = twin
        elif op == "pickle":
            cache = pickle.loads(pickle.dumps(cache))
        elif op == "write_view" and ref.offset:
            k, v = cache.read()
            k.add_(1.0)
            v[:, :, :1].fill_(7.0)
        elif op == "write_state":
            for t in cache.state:
                t.zero_()
        elif op == "release":
            cache.release_view()
        _check_equal(cache, ref)


_HF_OPS = st.one_of(
    st.tuples(st.just("step"), st.integers(1, 11), st.just([])),
    st.tuples(st.just("crop"), st.integers(-12, 0), st.just([])),
    st.tuples(
        st.sampled_from(["reorder_cache", "batch_select_indices"]),
        st.just(0),
        st.lists(st.integers(0, 50), min_size=1, max_size=3),
    ),
    st.tuples(st.just("batch_repeat_interleave"), st.integers(1, 2), st.just([])),
    st.tuples(st.sampled_from(["deepcopy", "pickle"]), st.just(0), st.just([])),
)


@op_sequences(_HF_OPS, max_batch=2, max_ops=10)
def test_flashcodec_cache_follows_dynamic_cache(dtype, batch, seed, ops):
    layers = 2
    cache = FlashCodecCache(codec=PNGCodec(4, keep_ratio=1.0), initial_blocks=1)
    ref = DynamicCache()
    for step, (op, n, raw) in enumerate(ops):
        if op == "step":
            held = getattr(ref.layers[0], "keys", None) if ref.layers else None
            b = held.shape[0] if held is not None else batch
            for i in range(layers):
                k = _tokens(seed + 31 * step + i, b, n, D, dtype)
                v = _tokens(seed + 31 * step + i + 10**6, b, n, D, dtype)
                got = cache.update(k, v, i)
                want = ref.update(k, v, i)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        elif op == "crop":
            cache.crop(n)
            ref.crop(n)
        elif op in ("reorder_cache", "batch_select_indices"):
            if not ref.get_seq_length():
                continue
            idx = _batch_index(raw, ref.layers[0].keys.shape[0])
            getattr(cache, op)(torch.tensor(idx))
            # DynamicCache's reorder_cache uses index_select, which takes no negative index
            plain = [i % ref.layers[0].keys.shape[0] for i in idx] if op == "reorder_cache" else idx
            getattr(ref, op)(torch.tensor(plain))
        elif op == "batch_repeat_interleave":
            cache.batch_repeat_interleave(n)
            ref.batch_repeat_interleave(n)
        elif op == "deepcopy":
            cache = copy.deepcopy(cache)
        elif op == "pickle":
            cache = pickle.loads(pickle.dumps(cache))
        assert cache.get_seq_length() == ref.get_seq_length()
        if ref.get_seq_length():
            for i in range(layers):
                ours = cache.layers[i].codec_cache.read()
                theirs = (ref.layers[i].keys, ref.layers[i].values)
                assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def _invalid_calls(batch: int, dtype: torch.dtype) -> dict:
    """Calls that must be refused, as functions of the cache (built for its current batch and dtype)."""
    good = _tokens(0, batch, 2, D, dtype)
    good_v = _tokens(1, batch, 2, DV, dtype)
    other = torch.float16 if dtype != torch.float16 else torch.float32
    nan = good.clone()
    nan[0, 0, 0, 0] = float("nan")
    return {
        "keys-not-tensor": lambda c: c.update_and_fetch(good.tolist(), good_v),
        "rank-3": lambda c: c.update_and_fetch(good[0], good_v[0]),
        "s-mismatch": lambda c: c.update_and_fetch(good, good_v[:, :, :1]),
        "heads-changed": lambda c: c.update_and_fetch(good[:, :1], good_v[:, :1]),
        "batch-changed": lambda c: c.update_and_fetch(torch.cat([good, good]), torch.cat([good_v, good_v])),
        "dim-changed": lambda c: c.update_and_fetch(good[..., :2], good_v),
        "dtype-changed": lambda c: c.update_and_fetch(good.to(other), good_v.to(other)),
        "kv-dtypes-differ": lambda c: c.update_and_fetch(good, good_v.to(other)),
        "int-dtype": lambda c: c.update_and_fetch(good.long(), good_v.long()),
        "nan": lambda c: c.update_and_fetch(nan, good_v),
        "empty-step": lambda c: c.update_and_fetch(good[:, :, :0], good_v[:, :, :0]),
        "crop-float": lambda c: c.crop(1.5),
        "crop-bool": lambda c: c.crop(True),
        "trim-negative": lambda c: c.trim(-1),
        "reorder-out-of-range": lambda c: c.reorder(torch.tensor([batch])),
        "reorder-too-negative": lambda c: c.reorder(torch.tensor([-batch - 1])),
        "reorder-float": lambda c: c.reorder(torch.tensor([0.0])),
        "reorder-empty": lambda c: c.reorder(torch.tensor([], dtype=torch.long)),
        "reorder-2d": lambda c: c.reorder(torch.zeros(1, 1, dtype=torch.long)),
        "from-state-truncated": lambda c: CodecKVCache.from_state(c.state[:-1], c.meta_state),
    }


_INVALID_NAMES = sorted(_invalid_calls(1, torch.float32))


@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    prefix=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    cut=st.integers(0, 20),
    bad=st.lists(st.sampled_from(_INVALID_NAMES), min_size=1, max_size=4),
)
def test_invalid_calls_raise_and_change_nothing(dtype, batch, seed, prefix, cut, bad):
    cache = CodecKVCache(codec=PNGCodec(4, keep_ratio=1.0), initial_blocks=1)
    twin = CodecKVCache(codec=PNGCodec(4, keep_ratio=1.0), initial_blocks=1)
    for i, n in enumerate(prefix):
        k, v = _tokens(seed + i, batch, n, D, dtype), _tokens(seed + i + 99, batch, n, DV, dtype)
        cache.update_and_fetch(k, v)
        twin.update_and_fetch(k, v)
    cache.crop(cut)
    twin.crop(cut)
    calls = _invalid_calls(batch, dtype)
    for name in bad:
        before = snapshot(cache)
        with pytest.raises(KVSpecError) as info:
            calls[name](cache)
        assert isinstance(info.value, (ValueError, TypeError)), name
        assert snapshot(cache) == before, name
    k, v = _tokens(seed + 7, batch, 5, D, dtype), _tokens(seed + 8, batch, 5, DV, dtype)
    ours, theirs = cache.update_and_fetch(k, v), twin.update_and_fetch(k, v)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


_TIER_NAMES = sorted(CODECS)
_TWIN_OPS = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 19)),
    st.tuples(st.just("crop"), st.integers(-25, 40)),
    st.tuples(st.sampled_from(["state", "deepcopy", "pickle", "release"]), st.just(0)),
)


@given(
    tier=st.sampled_from(_TIER_NAMES),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
    ops=st.lists(_TWIN_OPS, min_size=1, max_size=12),
)
def test_every_tier_survives_copies_and_round_trips_exactly(tier, dtype, seed, ops):
    """On every tier (lossy ones included), a cache that is saved / restored, copied or has its view
    dropped between calls returns exactly what an untouched twin fed the same calls returns."""
    cache, twin = CodecKVCache(codec=CODECS[tier]), CodecKVCache(codec=CODECS[tier])
    for step, (op, n) in enumerate(ops):
        if op == "append":
            k = _tokens(seed + step, 2, n, 8, dtype)
            v = _tokens(seed + step + 10**6, 2, n, 8, dtype)
            ours, theirs = cache.update_and_fetch(k, v), twin.update_and_fetch(k, v)
            assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
        elif op == "crop":
            cache.crop(n)
            twin.crop(n)
        elif op == "state":
            cache = CodecKVCache.from_state(cache.state, cache.meta_state)
        elif op == "deepcopy":
            cache = copy.deepcopy(cache)
        elif op == "pickle":
            cache = pickle.loads(pickle.dumps(cache))
        elif op == "release":
            cache.release_view()
        assert cache.offset == twin.offset and cache.nbytes == twin.nbytes
        if twin.offset:
            ours, theirs = cache.read(), twin.read()
            assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
