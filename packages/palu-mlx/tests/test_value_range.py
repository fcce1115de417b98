"""Values a cache's storage cannot hold raise a clear error and change nothing, never inf/NaN
downstream : float16 scales, biases, latents and projections top out at 65504."""

from __future__ import annotations

import mlx.core as mx
import pytest
from cache_snapshots import build, kv, palu, snapshot
from kvspec import KVValueError
from palu_mlx.lowrank import GroupProjection
from palu_mlx.mixed_bit import MixedBitCoder, Segment


def finite(*arrays: mx.array) -> bool:
    return all(mx.all(mx.isfinite(a)).item() for a in arrays)


# the quantized palu tiers store 16-bit scales: float16 for float32 and float16 inputs
@pytest.mark.parametrize("which", ["keys", "values"])
@pytest.mark.parametrize("kind", ["palu-fitted", "palu-pre-rope"])
def test_fitted_cache_refuses_latents_beyond_float16_scales(kind, which):
    cache = build(kind)
    before = snapshot(cache)
    k, v = kv(1, 3)
    big = (k * 1e6, v) if which == "keys" else (k, v * 1e6)
    with pytest.raises(KVValueError, match="do not fit the coder's storage.*65504"):
        cache.update_and_fetch(*big)
    assert snapshot(cache) == before


def test_float16_input_within_range_whose_latents_are_not():
    # 40,000 is a finite float16, but its latent (the projection of a 32-dim vector) is ~226,000
    cache = build("palu-fitted", mx.float16)
    before = snapshot(cache)
    _, v = kv(1, 3, mx.float16)
    with pytest.raises(KVValueError, match="65504"):
        cache.update_and_fetch(mx.full((1, 2, 1, 32), 40000, mx.float16), v)
    assert snapshot(cache) == before


@pytest.mark.parametrize("which", ["keys", "values"])
def test_fit_on_values_beyond_float16_raises_and_stays_exact(which):
    cache = build("palu-exact")
    before = snapshot(cache)
    k, v = kv(3, 4)
    big = (k * 1e6, v) if which == "keys" else (k, v * 1e6)
    with pytest.raises(KVValueError, match="float16's range"):
        cache.update_and_fetch(*big)  # 5 + 3 tokens reach the fit
    assert snapshot(cache) == before and not cache.fitted


@pytest.mark.parametrize("kind", ["palu-fixed", "palu-fitted-unquantized", "calibrated", "naive"])
def test_formats_with_float32_side_information_keep_large_values_finite(kind):
    # fixed quantizers clip to their end levels; unquantized latents keep the input dtype
    cache = build(kind)
    k, v = kv(1, 3)
    keys, values = cache.update_and_fetch(k * 1e6, v * 1e6)
    assert finite(keys, values)


def test_bfloat16_scales_hold_what_bfloat16_inputs_hold():
    cache = build("palu-fitted", mx.bfloat16)
    k, v = kv(1, 3, mx.bfloat16)
    keys, values = cache.update_and_fetch(k * 1e30, v)
    assert finite(keys, values) and keys.dtype == mx.bfloat16


def test_coder_refuses_non_finite_latents_and_float16_overflow():
    coder = MixedBitCoder((Segment(0, 4, 2), Segment(4, 8, 16)), 4, mx.float16, mx.float16)
    ok = coder.encode(mx.ones((3, 8)))
    assert set(ok) == {"seg0.codes", "seg0.scales", "seg0.biases", "seg1.values"}
    with pytest.raises(KVValueError, match="65504"):
        coder.encode(
            mx.concatenate([mx.zeros((1, 4)), mx.full((1, 4), 70000.0)], axis=-1)
        )  # unquantized part
    with pytest.raises(KVValueError, match="not finite"):
        coder.encode(mx.full((1, 8), float("nan")))


def test_projection_cast_refuses_overflow():
    proj = GroupProjection(mx.zeros((1, 4, 2)), mx.full((1, 4), 1e6), mx.ones((1, 2)))
    with pytest.raises(KVValueError, match="float16's range"):
        proj.astype(mx.float16)
    assert proj.astype(mx.bfloat16).mean.dtype == mx.bfloat16


def test_small_values_still_pass():
    cache = palu(palu_rank=8)
    k, v = kv(12, 7)
    keys, values = cache.update_and_fetch(k * 100, v * 100)
    assert cache.fitted and finite(keys, values)
