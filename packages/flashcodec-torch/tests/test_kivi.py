"""KIVICodec (keys per (block, channel), values per token) and its value codec TokenIntCodec."""

from __future__ import annotations

import pytest
import torch
from conftest import CODECS
from flashcodec import CodecKVCache
from flashcodec.attention import (
    codec_decode_attention,
    codec_prefill_attention,
    materialized_decode_attention,
    materialized_prefill_attention,
)
from flashcodec.codecs import ChannelInt4Codec, KIVICodec, TokenIntCodec, make_codec
from flashcodec.codecs.kivi import dequantize_zero, quantize_zero
from kvspec import KVConfigError, KVDataError, KVShapeError


def kv(b=2, h=2, s=203, d=16, seed=0, dtype=torch.float32):
    """Keys with two outlier channels and a distinct first token (a sink), values per token sized."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, s, d, generator=g)
    k[..., 3] = 8 + 4 * k[..., 3]  # an outlier channel, off zero
    k[..., 7] *= 6
    k[:, :, 0] = 5 * torch.randn(b, h, d, generator=g)  # the sink: unlike the other keys
    v = torch.randn(b, h, s, d, generator=g) * torch.rand(b, h, s, 1, generator=g).mul(4).add(0.1)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [-1, -2])
def test_quantize_zero_is_within_half_a_step(bits, dim):
    x = torch.randn(3, 5, 8, 16) * torch.rand(3, 5, 8, 1) * 10
    codes, scale, zero = quantize_zero(x, bits, dim)
    assert codes.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert scale.dtype == zero.dtype == torch.float16
    back = dequantize_zero(codes, scale, zero, 16)
    assert ((back - x).abs() <= scale.float() / 2 * (1 + 1e-3) + 1e-6).all()
    if bits == 8:
        assert int(codes.min()) >= -127  # -128 is never written (the state check refuses it)


def test_four_bit_keys_equal_chan_int4():
    """At 4 bits and without the sink, the keys are chan-int4's codes bit for bit."""
    k, _ = kv()
    x = k[:, :, :192]
    ours = KIVICodec(64, exact_sink=False).encode(x)
    theirs = ChannelInt4Codec(64).encode(x)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("bits,bound", [(4, 0.08), (8, 0.005)])
def test_values_per_token_round_trip(bits, bound):
    _, v = kv()
    codec = TokenIntCodec(8, bits)
    back = codec.roundtrip(v[:, :, :200])
    rel = (back - v[:, :, :200]).norm() / v[:, :, :200].norm()
    assert 0 < rel < bound
    # per token: a token's error is bounded by its own range, whatever the others hold
    err = (back - v[:, :, :200]).abs().amax(-1)
    rng = v[:, :, :200].amax(-1) - v[:, :, :200].amin(-1)
    assert (err <= rng / (2**bits - 2) + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exact_sink_keeps_the_first_key(dtype):
    k, v = kv(dtype=dtype)
    cache = CodecKVCache(codec=KIVICodec(16, raw_window=16))
    keys, values = cache.update_and_fetch(k, v)
    # bit for bit in bf16 and fp16 (the zero point is fp16); fp32 keys come back rounded to fp16
    assert torch.equal(keys[:, :, 0], k[:, :, 0].half().to(dtype))
    off = CodecKVCache(codec=KIVICodec(16, raw_window=16, exact_sink=False))
    keys_off, _ = off.update_and_fetch(k, v)
    assert not torch.equal(keys_off[:, :, 0], k[:, :, 0])
    # only block 0 differs; the values never do
    assert torch.equal(keys[:, :, 16:], keys_off[:, :, 16:])
    assert torch.equal(values, off.read()[1])


def test_exact_sink_across_appends():
    """The first block is coded with the sink whether it completes in one call or over many."""
    k, v = kv(s=80, dtype=torch.bfloat16)
    whole = CodecKVCache(codec=KIVICodec(16, raw_window=0, window_bits=None))
    whole.append(k, v)
    steps = CodecKVCache(codec=KIVICodec(16, raw_window=0, window_bits=None))
    for i in range(0, 80, 7):
        steps.append(k[:, :, i : i + 7], v[:, :, i : i + 7])
    assert all(torch.equal(a, b) for a, b in zip(whole.state, steps.state, strict=True))
    assert torch.equal(whole.read()[0][:, :, 0], k[:, :, 0])


def test_storage_is_measured_from_the_arrays():
    k, v = kv(b=1, h=2, s=64 * 3 + 70, d=64, dtype=torch.bfloat16)
    cache = CodecKVCache(codec=CODECS["kivi64-k4v4-w64i8"])
    cache.append(k, v)
    st = cache.storage_bytes()
    assert st.held == sum(t.nbytes for t in cache.state)
    # 3 blocks archived (the newest 64 + 6 tokens stay in the window): codes + fp16 pairs per side
    key_block, value_block = 64 * 32 + 64 * 4, 64 * 32 + 64 * 4
    assert st.used == 2 * 3 * (key_block + value_block)
    assert st.tail == 2 * 2 * 70 * (64 + 8)
    # keys: scales per channel, values: per token
    key_parts = cache.keys.archived_parts()
    value_parts = cache.values.archived_parts()
    assert key_parts[1].shape == (1, 2, 3, 1, 64) and value_parts[1].shape == (1, 2, 3, 64, 1)


@pytest.mark.parametrize("name", ["kivi64-k4v4-w64i8", "kivi64-k8v8-w64i8"])
@pytest.mark.parametrize("groups", [1, 3])
def test_attention_on_the_codes_equals_decode_then_attend(name, groups):
    k, v = kv(b=2, h=2, s=64 * 3 + 77, d=64)
    cache = CodecKVCache(codec=CODECS[name])
    cache.append(k, v)
    q = torch.randn(2, 2 * groups, 1, 64, generator=torch.Generator().manual_seed(1))
    got = codec_decode_attention(q, cache.keys, cache.values, backend="torch")
    assert not cache.keys.has_view and not cache.values.has_view
    want = materialized_decode_attention(q, cache.keys, cache.values)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    # a multi-token step over the archive in chunks
    qs = torch.randn(2, 2 * groups, 5, 64, generator=torch.Generator().manual_seed(2))
    got = codec_prefill_attention(qs, cache.keys, cache.values)
    want = materialized_prefill_attention(qs, cache.keys, cache.values)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()


def test_kivi_beats_chan_int4_on_values_that_vary_per_token():
    """What the split is for: values whose size varies token to token lose less per token."""
    k, v = kv(s=64 * 4)
    ours = CodecKVCache(codec=KIVICodec(64, raw_window=0, window_bits=None))
    theirs = CodecKVCache(codec=ChannelInt4Codec(64))
    (_, v_ours), (_, v_theirs) = ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)
    assert (v_ours - v).norm() < 0.8 * (v_theirs - v).norm()


def test_state_round_trip_and_meta():
    k, v = kv(s=150, dtype=torch.bfloat16)
    cache = CodecKVCache(codec=KIVICodec(32, key_bits=4, value_bits=8, raw_window=20))
    cache.append(k, v)
    again = CodecKVCache.from_state(cache.state, cache.meta_state)
    assert again.codec == cache.codec and again.values.codec == cache.codec.value_codec
    assert all(torch.equal(a, b) for a, b in zip(cache.state, again.state, strict=True))
    more_k, more_v = kv(s=40, seed=3, dtype=torch.bfloat16)
    a, b = cache.update_and_fetch(more_k, more_v), again.update_and_fetch(more_k, more_v)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_state_with_the_values_coded_as_keys_is_refused():
    k, v = kv(s=150)
    cache = CodecKVCache(codec=KIVICodec(32, raw_window=20))
    cache.append(k, v)
    n = len(cache.codec.stream_state_specs(1))
    keys_twice = (*cache.state[:n], *cache.state[:n])  # per-channel scales where per-token ones belong
    with pytest.raises(KVDataError, match="values part 'scales'"):
        CodecKVCache.from_state(keys_twice, cache.meta_state)


def test_value_codec_is_the_codec_itself_elsewhere():
    codec = ChannelInt4Codec(64)
    assert codec.value_codec is codec
    kivi = KIVICodec(32, 4, 8, raw_window=10, window_bits=None)
    assert kivi.value_codec == TokenIntCodec(32, 8, raw_window=10, window_bits=None)
    assert make_codec(**kivi.config()) == kivi


@pytest.mark.parametrize(
    "options,match",
    [
        ({"key_bits": 3}, r"key_bits must be one of \(4, 8\); got 3"),
        ({"value_bits": 2}, r"value_bits must be one of \(4, 8\); got 2"),
        ({"key_bits": True}, r"key_bits must be one of"),
        ({"exact_sink": 1}, r"exact_sink must be a bool; got 1"),
        ({"block_size": 0}, r"block_size must be an integer >= 1; got 0"),
        ({"raw_window": -1}, r"raw_window must be an integer >= 0"),
        ({"window_bits": 4}, r"window_bits must be one of"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(KVConfigError, match=match):
        KIVICodec(**options)


def test_odd_dim_is_refused_up_front():
    cache = CodecKVCache(codec=KIVICodec(8))
    k = torch.randn(1, 1, 20, 15)
    with pytest.raises(KVShapeError, match="D must be even; got D=15"):
        cache.append(k, k)
    assert cache.keys is None and cache.offset == 0
    # 8-bit codes need no packing: an odd D is fine
    ok = CodecKVCache(codec=KIVICodec(8, 8, 8))
    ok.append(k, k)
    assert ok.offset == 20
