"""PNG codec: anchor + deltas, lossless tier (bitwise), Top-M pruning, variance collapse, autograd."""

from __future__ import annotations

import pytest
import torch
from conftest import gaussian, random_walk
from flashcodec import PNGCodec, delta_variance_ratio
from kvspec import KVConfigError


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_keep1_is_bitwise_lossless(dtype):
    # i.i.d. Gaussian is the hard case for deltas: neighbours often differ by orders of magnitude
    x = gaussian(b=2, h=4, s=512, d=64, dtype=dtype)
    codec = PNGCodec(8)
    anchors, deltas = codec.encode(x)
    assert anchors.dtype == dtype and anchors.shape == (2, 4, 64, 64)
    assert deltas.dtype == torch.float64 and deltas.shape == (2, 4, 64, 7, 64)
    y = codec.decode((anchors, deltas), dtype)
    assert y.dtype == dtype
    assert torch.equal(y, x)
    assert (y.float() - x.float()).abs().max() < 1e-6


def test_fp16_bitwise_on_extreme_dynamic_range():
    # the proof in codecs/png.py: any fp16 difference fits fp64 exactly; fp32 deltas would fail here
    x = torch.tensor([65504.0, 2**-24, -65504.0, 6e-8, 1.0, -(2**-14), 60000.0, 0.0], dtype=torch.float16)
    x = x.reshape(1, 1, 8, 1).repeat(1, 1, 2, 3)
    assert torch.equal(PNGCodec(8).roundtrip(x), x)
    lossy = PNGCodec(8, delta_dtype=torch.float32).roundtrip(x)
    assert not torch.equal(lossy, x)  # why float64 is the default


def test_float32_deltas_are_lossless_within_rounding():
    x = gaussian(s=256, d=32, dtype=torch.bfloat16)
    codec = PNGCodec(8, delta_dtype="float32")
    assert codec.encode(x)[1].dtype == torch.float32
    y = codec.roundtrip(x)
    rel = (y.float() - x.float()).norm() / x.float().norm()
    assert rel < 1e-5


def test_top_m_keeps_the_largest_deltas_per_block():
    x = random_walk(s=64, d=16)
    codec = PNGCodec(8, keep_ratio=0.25)
    _, deltas = codec.encode(x)
    _, full = PNGCodec(8).encode(x)
    m = codec.kept_per_block(16)
    assert m == 28  # ceil(0.25 * 7 * 16)
    kept = (deltas != 0).flatten(-2).sum(-1)
    assert int(kept.max()) <= m
    # every kept delta is at least as large as every dropped one, block by block
    flat, ref = deltas.flatten(-2), full.flatten(-2).abs()
    smallest_kept = torch.where(flat != 0, ref, torch.inf).amin(-1)
    largest_dropped = torch.where(flat == 0, ref, 0).amax(-1)
    assert torch.all(smallest_kept >= largest_dropped)
    assert deltas.shape == full.shape  # dense layout keeps its size


def test_error_falls_as_keep_ratio_rises():
    x = random_walk(s=128, d=16)
    errs = [float((PNGCodec(8, keep_ratio=k).roundtrip(x) - x).norm()) for k in (0.1, 0.3, 0.6, 1.0)]
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False)), errs
    assert errs[-1] == 0


def test_delta_variance_collapse_on_smooth_signal_is_reported():
    smooth = random_walk(s=2048, d=64, step=0.05)
    noise = gaussian(s=2048, d=64)
    ratio_smooth, ratio_noise = delta_variance_ratio(smooth), delta_variance_ratio(noise)
    print(f"Var(delta)/Var(x): random walk {ratio_smooth:.4f}, iid gaussian {ratio_noise:.3f}")
    assert ratio_smooth < 0.1
    assert ratio_noise == pytest.approx(2.0, rel=0.05)  # independent neighbours: Var(a - b) = 2 Var


@pytest.mark.parametrize("keep_ratio", [1.0, 0.5])
def test_reconstruction_is_differentiable(keep_ratio):
    x = random_walk(s=32, d=8).requires_grad_(True)
    codec = PNGCodec(8, keep_ratio=keep_ratio)
    y = codec.roundtrip(x)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    if keep_ratio == 1.0:
        assert torch.allclose(x.grad, torch.ones_like(x))  # identity map


def test_synthesis_matrix_is_the_cumsum():
    x = gaussian(s=16, d=4)
    codec = PNGCodec(8)
    rows = codec.stored_rows(codec.encode(x), torch.float64)
    a = codec.synthesis_matrix(torch.float64)
    assert torch.equal(a, torch.ones(8, 8, dtype=torch.float64).tril())
    assert torch.allclose((a @ rows).reshape(x.shape).float(), x, atol=1e-6)


def test_block_size_one_stores_anchors_only():
    x = gaussian(s=5, d=4)
    anchors, deltas = PNGCodec(1).encode(x)
    assert deltas.shape == (2, 3, 5, 0, 4)
    assert torch.equal(PNGCodec(1).decode((anchors, deltas), x.dtype), x)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(keep_ratio=0.0), "keep_ratio"),
        (dict(keep_ratio=1.5), "keep_ratio"),
        (dict(keep_ratio=float("nan")), "keep_ratio"),
        (dict(keep_ratio="1"), "keep_ratio"),
        (dict(block_size=-1), "block_size"),
        (dict(delta_dtype=torch.float16), "delta_dtype"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(KVConfigError, match=match):
        PNGCodec(**kwargs)


def test_signed_zero_comes_back_positive_everywhere():
    # a delta cannot carry the sign of a zero: -0.0 is returned as +0.0, anchors included,
    # and every other element keeps its bits
    x = torch.tensor([-0.0, -0.0, 1.5, -0.0, 0.0, -2.0, -0.0, 3.0], dtype=torch.float16).reshape(1, 1, 8, 1)
    y = PNGCodec(8).roundtrip(x)
    assert torch.equal(y, x)  # equal values
    want_bits = (x + 0.0).view(torch.int16)
    assert torch.equal(y.view(torch.int16), want_bits)
    assert not torch.signbit(y[x == 0]).any()
