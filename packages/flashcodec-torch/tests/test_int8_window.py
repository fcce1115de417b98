"""``window_bits=8``: the tail (raw window + incomplete block) stored in int8 per token."""

from __future__ import annotations

import pytest
import torch
from conftest import random_walk
from flashcodec import CodecKVCache
from flashcodec.attention import codec_decode_attention
from flashcodec.codecs import ZeroPointJPEGCodec
from flashcodec.codecs.tail import RawTail, Uint8Tail
from kvspec import KVConfigError, KVDataError

R, W, D = 8, 24, 16
STEPS = (37, 1, 1, 3, 20, 1, 1, 1, 9, 40, 1, 5)
CODEC = ZeroPointJPEGCodec(R, raw_window=W, window_bits=8)


def _fed(steps=STEPS, dtype=torch.float32):
    cache = CodecKVCache(codec=CODEC)
    xs = []
    for i, s in enumerate(steps):
        k = random_walk(b=2, h=2, s=s, d=D, seed=i, dtype=dtype)
        cache.update_and_fetch(k, k * 0.5)
        xs.append(k)
    return cache, torch.cat(xs, dim=2)


def _int8(x: torch.Tensor) -> torch.Tensor:
    return Uint8Tail().decode(Uint8Tail().encode(x), x.dtype)


def test_int8_tail_round_trip_is_within_half_a_step_per_token():
    x = random_walk(b=2, h=3, s=11, d=D, seed=1) * 7
    x[0, 0, 4] = 2.5  # a constant token: scale 0, stored exactly
    codes, scale, zero = Uint8Tail().encode(x)
    assert codes.dtype == torch.uint8 and scale.dtype == zero.dtype == torch.float32
    assert codes.shape == x.shape and scale.shape == zero.shape == (2, 3, 11, 1)
    back = Uint8Tail().decode((codes, scale, zero), torch.float32)
    assert bool(((back - x).abs() <= scale / 2 * (1 + 1e-5) + 1e-6).all())
    assert torch.equal(back[0, 0, 4], x[0, 0, 4])
    raw = RawTail().encode(x)
    assert raw[0] is x and RawTail().decode(raw, x.dtype) is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_window_is_the_int8_tokens_and_blocks_are_coded_from_what_was_held(dtype):
    # one token a step: every token waits in the int8 tail, so its block is coded from the int8 values
    cache, x = _fed(steps=(1,) * 70, dtype=dtype)
    n, st = x.shape[2], cache.keys
    assert W <= st.tail_len < W + R and st.n_blocks * R + st.tail_len == n
    keys = st.read()
    stored = _int8(x)
    assert torch.equal(keys[:, :, n - st.tail_len :], stored[:, :, n - st.tail_len :])
    plain = CodecKVCache(codec=ZeroPointJPEGCodec(R))
    plain_keys, _ = plain.update_and_fetch(stored, stored)
    coded = st.n_blocks * R
    assert torch.equal(keys[:, :, :coded], plain_keys[:, :, :coded]) and keys.dtype == dtype
    # one prefill: the blocks take the tokens as given, only the window is stored in int8
    once = CodecKVCache(codec=CODEC)
    keys, _ = once.update_and_fetch(x, x)
    plain_keys, _ = CodecKVCache(codec=ZeroPointJPEGCodec(R)).update_and_fetch(x, x)
    assert torch.equal(keys[:, :, :coded], plain_keys[:, :, :coded])
    assert torch.equal(keys[:, :, coded:], stored[:, :, coded:])


def test_tail_bytes_are_codes_plus_two_fp32_per_token():
    cache, _ = _fed()
    st, per_token = cache.storage_bytes(), D + 2 * 4
    assert st.tail == 2 * 2 * 2 * cache.keys.tail_len * per_token
    assert sum(b.nbytes for b in cache.keys._tail) == 2 * 2 * cache.keys.tail_capacity * per_token


def test_state_round_trip_and_its_checks():
    cache, _ = _fed()
    state, meta = cache.state, cache.meta_state
    assert "dtype=float32" in meta and [t.dtype for t in state[3:6]] == [
        torch.uint8,
        torch.float32,
        torch.float32,
    ]
    restored = CodecKVCache.from_state(state, meta)
    assert restored.codec == CODEC and restored.keys.dtype == torch.float32
    step = random_walk(b=2, h=2, s=9, d=D, seed=7)
    assert torch.equal(restored.update_and_fetch(step, step)[0], cache.update_and_fetch(step, step)[0])
    older = tuple(
        "format=flashcodec-cache-2" if m.startswith("format=") else m
        for m in meta
        if not m.startswith("dtype=")
    )
    with pytest.raises(KVConfigError, match="meta_state format must be"):
        CodecKVCache.from_state(state, older)
    bad = list(state)
    bad[4] = -bad[4].abs() - 1
    with pytest.raises(KVDataError, match="keys part 'tail_scales' holds a negative scale"):
        CodecKVCache.from_state(bad, meta)
    bad = list(state)
    bad[3] = bad[3].to(torch.int16)
    with pytest.raises(KVDataError, match="keys tail_codes must be"):
        CodecKVCache.from_state(bad, meta)
    with pytest.raises(KVConfigError, match="dtype must be None or one of"):
        CodecKVCache.from_state(state, tuple("dtype=int8" if m.startswith("dtype=") else m for m in meta))


def test_crop_inside_the_window_then_append():
    cache, x = _fed()
    n = x.shape[2]
    before = cache.keys.read().clone()
    cache.crop(n - 5)  # inside the tail: nothing is re-stored
    assert torch.equal(cache.keys.read(), before[:, :, : n - 5])
    # inside an archived block: the cut block's first 6 decoded tokens go back to the tail, in int8
    cache.crop(30)
    got = cache.keys.read()
    assert torch.equal(got[:, :, :24], before[:, :, :24])
    torch.testing.assert_close(got[:, :, 24:], _int8(before[:, :, 24:30]), rtol=0, atol=0)
    more = random_walk(b=2, h=2, s=30, d=D, seed=99)
    keys, _ = cache.update_and_fetch(more, more)
    assert keys.shape[2] == 60 and torch.equal(keys[:, :, -W:], _int8(more)[:, :, -W:])


def test_reorder_gathers_the_int8_tail():
    cache, _ = _fed()
    before = cache.keys.read().clone()
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.keys.read(), before[[1, 1]])


def test_decode_attention_on_the_codes_reads_the_int8_window():
    cache, _ = _fed()
    q = torch.randn(2, 4, 1, D, generator=torch.Generator().manual_seed(3))
    keys, values = cache.keys.read().float(), cache.values.read().float()
    want = torch.softmax(torch.einsum("bhgd,bhtd->bhgt", q.view(2, 2, 2, D), keys) / 4, -1)
    want = torch.einsum("bhgt,bhtd->bhgd", want, values).reshape(2, 4, 1, D)
    got = codec_decode_attention(q, cache.keys, cache.values, scale=0.25)
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [4, 16, 8.0, True, "8"])
def test_bad_window_bits_are_refused(bad):
    with pytest.raises(KVConfigError, match=r"window_bits must be one of \(None, 8\)"):
        ZeroPointJPEGCodec(R, raw_window=W, window_bits=bad)
