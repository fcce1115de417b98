"""A codec's raw window: the newest tokens stay raw, older blocks are coded exactly as without it."""

from __future__ import annotations

import pytest
import torch
from conftest import random_walk
from flashcodec import CodecKVCache, JPEGCodec
from flashcodec.attention import codec_decode_attention
from flashcodec.codecs import ZeroPointJPEGCodec
from flashcodec.stream import tail_slots
from kvspec import KVConfigError, KVDataError

R = 8
STEPS = (37, 1, 1, 3, 20, 1, 1, 1, 9, 64, 1, 5)


def _fed(window: int, steps=STEPS):
    cache = CodecKVCache(codec=ZeroPointJPEGCodec(R, raw_window=window))
    xs = []
    for i, s in enumerate(steps):
        k = random_walk(b=2, h=2, s=s, d=16, seed=i)
        cache.update_and_fetch(k, k * 0.5)
        xs.append(k)
    return cache, torch.cat(xs, dim=2)


@pytest.mark.parametrize("window", [0, 5, 16, 64])
def test_the_newest_tokens_stay_raw_and_older_blocks_are_coded_as_without_a_window(window):
    cache, x = _fed(window)
    n = x.shape[2]
    keys = cache.keys.read()
    raw = min(n, window)
    assert torch.equal(keys[:, :, n - raw :], x[:, :, n - raw :])
    st = cache.keys
    assert window <= st.tail_len < window + R and st.n_blocks * R + st.tail_len == n
    plain = CodecKVCache(codec=ZeroPointJPEGCodec(R))
    plain_keys, _ = plain.update_and_fetch(x, x * 0.5)
    coded = st.n_blocks * R
    assert torch.equal(keys[:, :, :coded], plain_keys[:, :, :coded])


@pytest.mark.parametrize(
    ("block", "window", "capacities"),
    [(8, 0, {8}), (8, 24, {32}), (8, 96, {104}), (64, 64, {64, 80, 96, 112, 128})],
)
def test_the_tail_buffers_follow_the_tail(block, window, capacities):
    # after every append the buffers hold r + w slots less every whole TAIL_STEP the tail leaves
    # empty: a 64-token block behind a 64-token window keeps 64-127 tokens, not a fixed 128 slots,
    # and a tail that never leaves 16 slots empty keeps one buffer (written in place)
    cache = CodecKVCache(codec=ZeroPointJPEGCodec(block, raw_window=window, window_bits=8))
    steps, at, seen, buffers = [block + window + 5, *[1] * (block + window), 11, 40], 0, set(), set()
    x = random_walk(b=1, h=2, s=sum(steps), d=16, seed=3)
    for s in steps:
        cache.update_and_fetch(x[:, :, at : at + s], x[:, :, at : at + s])
        at += s
        for stream in (cache.keys, cache.values):
            slots = tail_slots(stream.tail_len, block + window)
            assert stream.tail_capacity == slots >= stream.tail_len, (s, stream.tail_len)
            assert all(buf.shape[2] == slots for buf in stream._tail)
        seen.add(cache.keys.tail_capacity)
        buffers.add(cache.keys._tail[0].data_ptr())
        assert cache.storage_bytes().allocated >= cache.storage_bytes().held
    assert seen == capacities
    assert (len(buffers) == 1) == (len(capacities) == 1)


@pytest.mark.parametrize("cut", [3, 40, 100, 140])
def test_crop_keeps_the_prefix_and_appends_resume(cut):
    cache, x = _fed(64)
    before = cache.keys.read().clone()
    cache.crop(cut)
    assert torch.equal(cache.keys.read(), before[:, :, :cut])
    more = random_walk(b=2, h=2, s=30, d=16, seed=99)
    keys, _ = cache.update_and_fetch(more, more * 0.5)
    assert keys.shape[2] == cut + 30 and torch.equal(keys[:, :, -30:], more)  # inside the window: raw
    assert cache.keys.tail_len < 64 + R


def test_state_round_trip_keeps_the_window_and_rejects_a_longer_tail():
    cache, _ = _fed(16)
    restored = CodecKVCache.from_state(cache.state, cache.meta_state)
    assert restored.codec == cache.codec and restored.keys.tail_len == cache.keys.tail_len
    step = random_walk(b=2, h=2, s=9, d=16, seed=7)
    assert torch.equal(restored.update_and_fetch(step, step)[0], cache.update_and_fetch(step, step)[0])
    no_window = CodecKVCache(codec=ZeroPointJPEGCodec(R))
    with pytest.raises(KVDataError, match="t < block_size=8"):
        no_window.from_state(cache.state, no_window.meta_state)


def test_decode_attention_on_the_codes_reads_the_window():
    cache, _ = _fed(64)
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(3))
    keys, values = cache.keys.read().float(), cache.values.read().float()
    want = torch.softmax(torch.einsum("bhgd,bhtd->bhgt", q.view(2, 2, 2, 16), keys) / 4, -1)
    want = torch.einsum("bhgt,bhtd->bhgd", want, values).reshape(2, 4, 1, 16)
    got = codec_decode_attention(q, cache.keys, cache.values, scale=0.25)
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_a_bad_window_is_refused(bad):
    with pytest.raises(KVConfigError, match="raw_window must be an integer >= 0"):
        ZeroPointJPEGCodec(R, raw_window=bad)


def test_codecs_without_the_field_keep_no_window():
    assert JPEGCodec(R).raw_window == 0 and CodecKVCache(codec=JPEGCodec(R)).codec.raw_window == 0
