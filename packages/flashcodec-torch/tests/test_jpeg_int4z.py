"""Asymmetric int4 jpeg (jpeg-int4z): the quantizer's error bound, stored bytes, row offsets, errors."""

from __future__ import annotations

import pytest
import torch
from conftest import random_walk
from flashcodec import CodecKVCache, JPEGCodec
from flashcodec.codecs import CODECS, ZeroPointJPEGCodec, make_codec
from flashcodec.codecs.quant import dequantize_int4_zero, quantize_int4_zero, unpack_int4
from kvspec import KVConfigError, KVDataError, KVShapeError


@pytest.mark.parametrize("shift", [0.0, 5.0, -300.0])
def test_quantizer_stays_within_half_a_step_of_its_stored_scale(shift):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 5, 64, generator=g) * torch.rand(7, 5, 1, generator=g) * 3 + shift
    packed, scale, zero = quantize_int4_zero(x)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 5, 32)
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == zero.shape == (7, 5, 1)
    back = dequantize_int4_zero(packed, scale, zero, 64)
    err = (back - x).abs().amax(-1, keepdim=True)
    assert (err <= scale.float() / 2 * (1 + 1e-5) + 1e-6).all()
    # all 16 levels are in use on a spread row: both ends of the range are reachable
    codes = unpack_int4(packed, 64)
    assert int(codes.min()) == -8 and int(codes.max()) == 7


def test_offset_rows_beat_symmetric_rows_at_the_same_bytes():
    # rows centred away from 0 (a channel offset): the zero point spends the levels on the range
    x = random_walk(s=64, d=16) + 4.0
    sym, zp = JPEGCodec(8, 8, quant_bits=4), ZeroPointJPEGCodec(8)
    assert zp.storage_ratio(16, torch.bfloat16) == sym.storage_ratio(16, torch.bfloat16)
    err_sym = (sym.roundtrip(x) - x).norm() / x.norm()
    err_zp = (zp.roundtrip(x) - x).norm() / x.norm()
    assert err_zp < 0.75 * err_sym


def test_constant_and_zero_rows():
    x = torch.zeros(1, 1, 8, 4)
    assert torch.equal(ZeroPointJPEGCodec(8).roundtrip(x), x)
    parts = ZeroPointJPEGCodec(8).encode(torch.full((1, 1, 8, 4), 2.5))
    assert torch.allclose(ZeroPointJPEGCodec(8).decode(parts, torch.float32), torch.full((1, 1, 8, 4), 2.5))


def test_parts_offsets_and_stored_rows_agree():
    codec = ZeroPointJPEGCodec(4, 3)
    x = random_walk(s=12, d=8)
    parts = codec.encode(x)
    assert [p.shape[-2:] for p in parts] == [(3, 4), (3, 1), (3, 1)]
    (codes,), scales = codec.row_segments(parts)
    offsets = codec.row_offsets(parts)
    assert codes is parts[0] and scales.dtype == offsets.dtype == torch.float32
    dense = unpack_int4(codes, 8).float() * scales[..., None] + offsets[..., None]
    assert torch.equal(dense, codec.stored_rows(parts, torch.float32))
    assert JPEGCodec(4, 3, quant_bits=4).row_offsets(JPEGCodec(4, 3, quant_bits=4).encode(x)) is None


def test_registry_keyword_form_and_config():
    assert CODECS["jpeg-int4z"] is ZeroPointJPEGCodec
    codec = make_codec("jpeg-int4z", block_size=8, keep_freqs=6)
    assert codec == ZeroPointJPEGCodec(8, 6) and codec.config() == {
        "mode": "jpeg-int4z",
        "block_size": 8,
        "keep_freqs": 6,
        "raw_window": 0,
        "window_bits": None,
    }
    assert ZeroPointJPEGCodec(8) == ZeroPointJPEGCodec(8, 8)


@pytest.mark.parametrize("bad", [0, 9, 2.0, True, "8"])
def test_bad_keep_freqs(bad):
    with pytest.raises(KVConfigError, match="keep_freqs"):
        ZeroPointJPEGCodec(8, bad)


def test_odd_head_dim_is_refused_before_anything_changes():
    cache = CodecKVCache(codec=ZeroPointJPEGCodec(8))
    with pytest.raises(KVShapeError, match="D must be even"):
        cache.append(torch.zeros(1, 1, 8, 5), torch.zeros(1, 1, 8, 5))
    assert cache.offset == 0


def test_parts_are_checked():
    with pytest.raises(KVShapeError, match="jpeg-int4z codec parts"):
        ZeroPointJPEGCodec(8).row_offsets((torch.zeros(1),))


def test_state_with_the_lowest_code_restores():
    # the minimum of every spread row is code -8 (nibble 0), which symmetric int4 never writes
    cache = CodecKVCache(codec=ZeroPointJPEGCodec(8))
    x = random_walk(s=21, d=8)
    cache.append(x, x + 1)
    codes = cache.keys.archived_parts()[0]
    assert bool(((codes & 15) == 0).any())
    back = CodecKVCache.from_state(cache.state, cache.meta_state)
    assert all(torch.equal(a, b) for a, b in zip(back.state, cache.state, strict=True))
    with pytest.raises(KVDataError, match="0 nibble"):
        sym = CodecKVCache(codec=JPEGCodec(8, 8, quant_bits=4))
        sym.append(x, x)
        state = list(sym.state)
        state[0] = state[0] & 0xF0  # low nibbles 0: not something symmetric int4 writes
        CodecKVCache.from_state(state, sym.meta_state)
