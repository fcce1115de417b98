"""Mixed-bit jpeg (bits per DCT frequency) and the variance-driven bit allocation.

Attention on its codes, causality, serialization and storage run through the shared suites
(``conftest.CODECS["jpeg-mixed-84"]``); this file checks the codec itself and the allocation.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_walk
from flashcodec import CodecKVCache, JPEGCodec
from flashcodec.codecs import MixedJPEGCodec, allocate_freq_bits, frequency_variances, make_codec
from flashcodec.codecs.quant import unpack_int4
from kvspec import KVConfigError, KVShapeError


def test_default_is_int8_dc_and_int4_elsewhere():
    codec = MixedJPEGCodec(8)
    assert codec.freq_bits == (8, 4, 4, 4, 4, 4, 4, 4)
    assert (codec.k8, codec.k4, codec.rows, codec.order) == (1, 7, 8, tuple(range(8)))
    assert make_codec("jpeg-mixed", block_size=8) == codec
    # 8 int8 bytes... per D: 1 row int8 + 7 rows int4 + 8 fp32 scales, over 8 tokens of fp32
    assert codec.storage_ratio(16, torch.float32) == pytest.approx((16 + 7 * 8 + 8 * 4) / (8 * 16 * 4))


def test_rows_are_ordered_by_width_and_the_synthesis_follows():
    codec = MixedJPEGCodec(4, freq_bits=(4, 8, 0, 8))
    assert codec.order == (1, 3, 0) and codec.rows == 3
    full = JPEGCodec(4).synthesis_matrix()
    assert torch.equal(codec.synthesis_matrix(), full[:, [1, 3, 0]])
    specs = codec.part_specs(6)
    assert [(s.name, s.shape, s.dtype) for s in specs] == [
        ("coeffs8", (2, 6), torch.int8),
        ("coeffs4", (1, 3), torch.uint8),
        ("scales", (3, 1), torch.float32),
    ]


@pytest.mark.parametrize("bits", [8, 4])
def test_uniform_bits_store_what_the_uniform_jpeg_codec_stores(bits):
    x = random_walk(s=48, d=16)
    mixed = MixedJPEGCodec(8, freq_bits=(bits,) * 8).encode(x)
    uniform = JPEGCodec(8, 8, quant_bits=bits).encode(x)
    assert len(mixed) == len(uniform) == 2
    assert all(torch.equal(a, b) for a, b in zip(mixed, uniform, strict=True))


def test_each_frequency_is_within_half_a_step_and_dropped_ones_are_zero():
    x = random_walk(s=64, d=16)
    codec = MixedJPEGCodec(8, freq_bits=(8, 4, 0, 4, 8, 0, 0, 4))
    c8, c4, scales = codec.encode(x)
    assert c8.dtype == torch.int8 and c4.dtype == torch.uint8 and scales.shape[-2:] == (5, 1)
    assert int(c8.abs().max()) == 127 and int(unpack_int4(c4, 16).abs().max()) == 7
    (exact,) = JPEGCodec(8).encode(x)  # all 8 frequencies, fp32
    rows = codec.stored_rows((c8, c4, scales), torch.float32)
    err = (rows - exact[..., list(codec.order), :]).abs()
    assert (err <= scales / 2 + 1e-6).all()
    y = codec.decode((c8, c4, scales), torch.float32)
    kept = torch.zeros_like(exact)
    kept[..., list(codec.order), :] = rows
    want = torch.matmul(JPEGCodec(8).synthesis_matrix(), kept).reshape(x.shape)
    assert torch.allclose(y, want, atol=1e-5)


def test_cache_round_trip_through_state_and_meta_state():
    codec = MixedJPEGCodec(8, freq_bits=(8, 8, 4, 4, 0, 0, 0, 0))
    cache = CodecKVCache(codec=codec)
    x = random_walk(s=45, d=16)
    k, _ = cache.update_and_fetch(x, x)
    k = k.clone()
    again = CodecKVCache.from_state(cache.state, cache.meta_state)
    assert again.codec == codec and torch.equal(again.read()[0], k)


BAD_CONFIGS = [
    dict(freq_bits=(8, 4)),  # wrong length
    dict(freq_bits=(0,) * 8),  # nothing stored
    dict(freq_bits=(8, 4, 4, 4, 4, 4, 4, 2)),  # 2 bits is not a width
    dict(freq_bits=(True,) + (4,) * 7),
    dict(freq_bits=5),
]


@pytest.mark.parametrize("kwargs", BAD_CONFIGS, ids=str)
def test_bad_configs_raise(kwargs):
    with pytest.raises(KVConfigError, match="freq_bits"):
        MixedJPEGCodec(8, **kwargs)


def test_odd_head_dim_is_refused_only_with_a_4_bit_frequency():
    with pytest.raises(KVShapeError, match="D must be even"):
        CodecKVCache(codec=MixedJPEGCodec(8)).append(torch.zeros(1, 1, 9, 7), torch.zeros(1, 1, 9, 7))
    CodecKVCache(codec=MixedJPEGCodec(8, freq_bits=(8, 8) + (0,) * 6)).append(
        torch.zeros(1, 1, 9, 7), torch.zeros(1, 1, 9, 7)
    )


# ---------------------------------------------------------------- allocation
def test_frequency_variances_add_up_to_the_signal_energy():
    x = random_walk(s=64, d=16)
    v = frequency_variances(x, 8)
    assert v.shape == (8,) and v.dtype == torch.float64
    assert float(v.sum()) == pytest.approx(8 * float(x.double().pow(2).mean()), rel=1e-5)  # Parseval
    assert float(v[0]) > 0.9 * float(v.sum())  # a random walk is smooth: the DC dominates


def test_allocation_follows_the_variances_within_the_budget():
    flat = [1.0] * 8
    assert allocate_freq_bits(flat, 4) == (4,) * 8
    assert allocate_freq_bits(flat, 8) == (8,) * 8
    keys = [0.51, 0.13, 0.086, 0.066, 0.056, 0.052, 0.048, 0.050]  # measured shape of real keys
    assert allocate_freq_bits(keys, 4.5) == (8, 4, 4, 4, 4, 4, 4, 4)
    assert allocate_freq_bits(keys, 5) == (8, 8, 4, 4, 4, 4, 4, 4)
    smooth = [1.0, 1e-3, 1e-5, 1e-6, 0, 0, 0, 0]
    assert allocate_freq_bits(smooth, 2) == (8, 4, 4, 0, 0, 0, 0, 0)  # quiet frequencies dropped
    for avg in (0.5, 1, 2.5, 4, 6, 7.5):
        bits = allocate_freq_bits(keys, avg)
        assert sum(bits) <= avg * 8 and all(b in (0, 4, 8) for b in bits)
    codec = MixedJPEGCodec.from_variances(keys, 4.5)
    assert codec == MixedJPEGCodec(8, freq_bits=(8, 4, 4, 4, 4, 4, 4, 4))


@pytest.mark.parametrize(
    "variances, avg",
    [
        ([1.0] * 8, 0.25),
        ([1.0] * 8, 9),
        ([1.0] * 8, True),
        ([1.0, -1.0], 4),
        ([float("nan")] * 4, 4),
        ([], 4),
    ],
    ids=["budget-low", "budget-high", "budget-bool", "negative", "nan", "empty"],
)
def test_bad_allocations_raise(variances, avg):
    with pytest.raises(KVConfigError, match="avg_bits|variances"):
        allocate_freq_bits(variances, avg)


def test_allocation_beats_uniform_int4_on_a_smooth_signal_at_equal_bytes():
    # the transform coder's gain: bits moved to the loud frequencies; uniform int4 over the DCT is
    # the per-token int4 error (an orthonormal transform does not change a uniform quantizer's error)
    x = random_walk(s=256, d=16)
    uniform = JPEGCodec(8, 8, quant_bits=4)
    allocated = MixedJPEGCodec.from_variances(frequency_variances(x), 4)
    assert allocated.storage_ratio(16, torch.float32) <= uniform.storage_ratio(16, torch.float32)

    def err(codec):
        return float((codec.roundtrip(x) - x).norm() / x.norm())

    assert err(allocated) < 0.5 * err(uniform)
