"""JPEG codec: orthonormal DCT-II basis, K = r lossless, low-K quality on smooth signals, int8."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import gaussian, random_walk
from flashcodec import JPEGCodec, dct_matrix
from flashcodec.codecs.quant import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from kvspec import KVConfigError, KVShapeError


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("r", [1, 2, 4, 8, 16])
def test_basis_is_orthonormal(r):
    m = dct_matrix(r, dtype=torch.float64)
    assert m.shape == (r, r)
    assert torch.allclose(m @ m.T, torch.eye(r, dtype=torch.float64), atol=1e-12)
    # the DCT-II formula of the codec docstring (codecs/jpeg.py), entry by entry
    n, j = 3 % r, r - 1
    c = math.sqrt(1 / r) if j == 0 else math.sqrt(2 / r)
    assert m[j, n].item() == pytest.approx(c * math.cos(math.pi / r * (n + 0.5) * j), abs=1e-14)


def test_truncated_basis_is_the_lowest_rows():
    full, low = dct_matrix(8, dtype=torch.float64), dct_matrix(8, 3, dtype=torch.float64)
    assert torch.equal(low, full[:3])
    assert torch.allclose(JPEGCodec(8, 3).synthesis_matrix(torch.float64), full[:3].T)


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-6), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)]
)
def test_k_equals_r_is_lossless_up_to_rounding(dtype, tol):
    x = gaussian(s=64, dtype=dtype)
    codec = JPEGCodec(8, 8)
    (coeffs,) = codec.encode(x)
    assert coeffs.shape == (2, 3, 8, 8, 16) and coeffs.dtype == dtype
    y = codec.decode((coeffs,), dtype)
    assert y.dtype == dtype and y.shape == x.shape
    rel = (y.float() - x.float()).norm() / x.float().norm()
    assert rel < tol


def test_k2_cosine_above_099_on_smooth_signal():
    x = random_walk(s=256, d=32, step=0.05)
    y = JPEGCodec(8, 2).roundtrip(x)
    assert cosine(x, y) > 0.99


def test_error_monotone_in_k():
    x = random_walk(s=256, d=32)
    errors = [float((JPEGCodec(8, k).roundtrip(x) - x).norm()) for k in range(1, 9)]
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < 1e-5 * float(x.norm())


def test_energy_is_preserved_by_orthonormal_transform():
    x = gaussian(s=32)
    (coeffs,) = JPEGCodec(8, 8).encode(x)
    assert torch.allclose(coeffs.double().pow(2).sum(), x.double().pow(2).sum(), rtol=1e-5)


def test_encode_is_one_map_over_all_blocks():
    # encoding the whole sequence equals encoding each block alone: no cross-block state
    x = gaussian(s=32)
    codec = JPEGCodec(8, 3)
    (whole,) = codec.encode(x)
    for b in range(4):
        (alone,) = codec.encode(x[:, :, 8 * b : 8 * b + 8])
        assert torch.allclose(whole[:, :, b : b + 1], alone, atol=1e-6)


def test_int8_stores_int8_with_one_scale_per_block_and_frequency():
    x = random_walk(s=64, d=16)
    codec = JPEGCodec(8, 2, quant_bits=8)
    q, scale = codec.encode(x)
    assert q.dtype == torch.int8 and q.shape == (2, 3, 8, 2, 16)
    assert scale.dtype == torch.float32 and scale.shape == (2, 3, 8, 2, 1)
    assert int(q.abs().max()) == 127  # each row's largest coefficient uses the full range
    y = codec.decode((q, scale), torch.float32)
    fp = JPEGCodec(8, 2).roundtrip(x)
    # int8 adds at most half a step per coefficient on top of the truncation error
    assert (y - fp).norm() < 0.02 * fp.norm()
    assert codec.storage_ratio(16, torch.float32) == pytest.approx((2 * 16 + 2 * 4) / (8 * 16 * 4))


def test_int4_packs_two_codes_a_byte_with_one_scale_per_block_and_frequency():
    x = random_walk(s=64, d=16)
    codec = JPEGCodec(8, 8, quant_bits=4)
    q, scale = codec.encode(x)
    assert q.dtype == torch.uint8 and q.shape == (2, 3, 8, 8, 8)  # D = 16 codes in 8 bytes
    assert scale.dtype == torch.float32 and scale.shape == (2, 3, 8, 8, 1)
    codes = unpack_int4(q, 16)
    assert int(codes.abs().max()) == 7 and int(codes.min()) >= -7  # full symmetric range, -8 unused
    y = codec.decode((q, scale), torch.float32)
    # at most half a step per coefficient; the basis is orthonormal, so the same bound in tokens
    step = scale.expand(*scale.shape[:-1], 16)
    fp = JPEGCodec(8, 8).encode(x)[0]
    assert ((dequantize_int4(q, scale, 16) - fp).abs() <= step / 2 + 1e-6).all()
    assert (y - x).norm() < 0.2 * x.norm()
    assert codec.storage_ratio(16, torch.float32) == pytest.approx((8 * 8 + 8 * 4) / (8 * 16 * 4))


@pytest.mark.parametrize("dim", [1, 2, 7, 64])
def test_int4_packing_round_trips(dim):
    g = torch.Generator().manual_seed(dim)
    codes = torch.randint(-8, 8, (3, 4, dim), generator=g)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 4, (dim + 1) // 2)
    assert torch.equal(unpack_int4(packed, dim), codes.to(torch.int8))
    # the layout the kernels read: element 2i in the low nibble of byte i, 2i+1 in the high one
    if dim >= 2:
        assert int(packed[0, 0, 0]) == (int(codes[0, 0, 0]) + 8) | ((int(codes[0, 0, 1]) + 8) << 4)
    q, scale = quantize_int4(torch.randn(5, dim, generator=g))
    assert torch.equal(pack_int4(unpack_int4(q, dim)), q)


def test_int4_needs_an_even_head_dim():
    with pytest.raises(KVShapeError, match="D must be even"):
        JPEGCodec(8, 8, quant_bits=4).check_dim(7)
    JPEGCodec(8, 8, quant_bits=8).check_dim(7)  # only int4 packs along D


def test_quantize_zero_rows_and_bounds():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    q, scale = quantize_int8(x)
    assert scale[0, 0] == 0 and torch.all(q[0] == 0)
    assert torch.allclose(dequantize_int8(q, scale), x, atol=float(scale[1, 0]) / 2 + 1e-7)


def test_decode_is_differentiable():
    coeffs = torch.randn(1, 1, 2, 8, 4, requires_grad=True)
    y = JPEGCodec(8, 8).decode((coeffs,), torch.float32)
    y.pow(2).sum().backward()
    # orthonormal synthesis preserves the energy, so d/dC sum(y^2) = 2 C
    assert torch.allclose(coeffs.grad, 2 * coeffs.detach(), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=2.5), "block_size"),
        (dict(block_size=True), "block_size"),
        (dict(block_size=8, keep_freqs=0), "keep_freqs"),
        (dict(block_size=8, keep_freqs=9), "keep_freqs"),
        (dict(block_size=8, quant_bits=3), "quant_bits"),
        (dict(block_size=8, quant_bits=16), "quant_bits"),
        (dict(block_size=8, quant_bits=4.0), "quant_bits"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(KVConfigError, match=match):
        JPEGCodec(**kwargs)


def test_length_must_be_whole_blocks():
    with pytest.raises(KVShapeError, match="multiple of block_size"):
        JPEGCodec(8).encode(torch.zeros(1, 1, 12, 4))
