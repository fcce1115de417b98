"""Attention on the latent codes: equal to rebuild-then-SDPA, chunk by chunk, under every mask
mlx-lm passes; routing an mlx-lm model to it and back."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import base as mlx_base
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache
from palu_helpers import make_tiny_qwen3, planted_lowrank, rel_err
from palu_mlx import KVCacheBuilder, KVCacheConfig, PaluKVCache
from palu_mlx.attention import latent_attention, route_attention, routed_sdpa, unroute_attention
from palu_mlx.rope import Rotary

D = 32
# float32 everywhere: the only difference between the two paths is summation order
TOL = 2e-5


def rotary() -> Rotary:
    return Rotary(mx.array(10000.0 ** (-np.arange(0, D, 2) / D), dtype=mx.float32), D, False)


def filled_cache(batch: int, tokens: int, config: KVCacheConfig, pre_rope: bool) -> PaluKVCache:
    cache = PaluKVCache(config, rotary=rotary() if pre_rope else None)
    keys = planted_lowrank((batch, 4, tokens, D), rank=6, seed=1, noise=0.05)
    values = planted_lowrank((batch, 4, tokens, D), rank=5, seed=2, noise=0.05)
    cache.update_and_fetch(keys[..., :40, :], values[..., :40, :])  # fits on the first 40
    cache.update_and_fetch(keys[..., 40:, :], values[..., 40:, :])
    assert cache.fitted
    return cache


def reference(queries, cache: PaluKVCache, scale, mask):
    keys, values = cache._fetch()
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


CONFIGS = {
    "full-rank-16bit": KVCacheConfig(method="palu", head_dim=D, palu_rank=D, palu_hi_bit=16, palu_lo_bit=16),
    "hi-lo-split": KVCacheConfig(method="palu", head_dim=D, palu_n_head_groups=2),
    "water-filling-2bit": KVCacheConfig(method="palu", head_dim=D, palu_bits=2.0, palu_n_head_groups=4),
    "sinks-token-scale-2bit": KVCacheConfig(
        head_dim=D, palu_bits=2.0, palu_sink_tokens=3, palu_token_scale=True
    ),
    "sinks-window-2bit": KVCacheConfig(
        method="palu", head_dim=D, palu_bits=2.0, palu_sink_tokens=3, palu_recent_tokens=20
    ),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("pre_rope", [True, False], ids=["pre-rope", "post-rope"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("chunk", [16, 1024], ids=["chunked", "one-chunk"])
def test_equals_rebuild_then_sdpa_for_decode_and_prefill(config, pre_rope, batch, chunk):
    cache = filled_cache(batch, 100, config, pre_rope)
    store = cache.latent_store()
    # GQA: 8 query heads over 4 KV heads; one decode query, then an 11-query causal chunk
    for n_q, mask in ((1, None), (11, "causal")):
        q = mx.random.normal((batch, 8, n_q, D), key=mx.random.key(n_q))
        got = latent_attention(q, store, 0.17, mask, chunk=chunk)
        assert got.shape == (batch, 8, n_q, D) and got.dtype == q.dtype
        assert rel_err(got, reference(q, cache, 0.17, mask)) < TOL


@pytest.mark.parametrize("kind", ["bool", "additive", "per-head-bool"])
def test_array_masks_as_mlx_lm_passes_them(kind):
    cache = filled_cache(2, 90, CONFIGS["water-filling-2bit"], pre_rope=True)
    q = mx.random.normal((2, 8, 7, D), key=mx.random.key(3))
    heads = 8 if kind == "per-head-bool" else 1
    keep = mx.random.uniform(shape=(2, heads, 7, 90), key=mx.random.key(4)) > 0.4
    keep[..., 0] = True  # every query row attends somewhere (as with left padding + causal)
    mask = keep if kind != "additive" else mx.where(keep, 0.0, -1e9)
    got = latent_attention(q, cache.latent_store(), 0.2, mask, chunk=32)
    assert rel_err(got, reference(q, cache, 0.2, mask)) < TOL


@pytest.mark.parametrize("kind", ["bool", "additive-inf"])
def test_a_chunk_masked_out_for_a_row_contributes_nothing(kind):
    cache = filled_cache(1, 80, CONFIGS["hi-lo-split"], pre_rope=True)
    q = mx.random.normal((1, 8, 3, D), key=mx.random.key(5))
    keep = mx.zeros((1, 1, 3, 80), dtype=mx.bool_)
    keep[..., 60:] = True  # the first three 16-token chunks are masked for every row
    mask = keep if kind == "bool" else mx.where(keep, 0.0, -float("inf"))
    got = latent_attention(q, cache.latent_store(), 0.3, mask, chunk=16)
    assert mx.all(mx.isfinite(got)).item()
    assert rel_err(got, reference(q, cache, 0.3, keep)) < TOL


def test_values_are_never_rebuilt():
    """The value latents are read, and the value projection is used once, on the attended rows."""
    cache = filled_cache(
        1, 64, replace(CONFIGS["hi-lo-split"], palu_sink_tokens=0, palu_recent_tokens=0), pre_rope=True
    )
    store = cache.latent_store()
    reads = []

    def spy(start, stop):
        reads.append((start, stop))
        return store.value_latents(start, stop)

    spied = replace(store, value_latents=spy)
    q = mx.random.normal((1, 8, 1, D), key=mx.random.key(6))
    # the latents reader (the packed one reads the codes itself: test_packed_attention.py)
    out = latent_attention(q, spied, 0.2, None, chunk=16, packed=False)
    assert reads == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert rel_err(out, reference(q, cache, 0.2, None)) < TOL
    # with exact first tokens, those are read from the exact rows and the codes from after them
    sunk = filled_cache(
        1, 64, replace(CONFIGS["hi-lo-split"], palu_sink_tokens=4, palu_recent_tokens=0), pre_rope=True
    )
    store = sunk.latent_store()
    reads.clear()
    out = latent_attention(q, replace(store, value_latents=spy), 0.2, None, chunk=16, packed=False)
    assert reads == [(4, 20), (20, 36), (36, 52), (52, 64)]
    assert rel_err(out, reference(q, sunk, 0.2, None)) < TOL


def test_an_unfitted_cache_offers_no_store_and_routes_to_mlx_sdpa():
    cache = PaluKVCache(KVCacheConfig(method="palu", head_dim=D))
    k = planted_lowrank((1, 4, 5, D), rank=3)
    keys, values = cache.update_and_fetch(k, k)
    assert cache.latent_store() is None
    q = mx.random.normal((1, 8, 1, D), key=mx.random.key(7))
    got = routed_sdpa(q, keys, values, cache=cache, scale=0.2, mask=None)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.2, mask=None)
    assert mx.array_equal(got, want).item()


def greedy(model, prompt, steps, caches) -> list[int]:
    gen = generate_step(mx.array(prompt), model, max_tokens=steps, prompt_cache=caches, prefill_step_size=48)
    return [int(tok) for tok, _ in gen]


def test_routed_model_matches_the_rebuilding_path_and_unroutes():
    model = make_tiny_qwen3(seed=3)
    config = KVCacheConfig(method="palu", head_dim=D, palu_bits=2.0, palu_n_head_groups=4)
    prompt = list(range(5, 125))
    unroute_attention(model)  # other tests' models (same family) may have routed it
    assert qwen3.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    rebuilt = greedy(model, prompt, 32, [PaluKVCache(config, rotary=rotary()) for _ in model.layers])
    caches = KVCacheBuilder.for_model(model, config)  # routes the qwen3 family
    assert qwen3.scaled_dot_product_attention is routed_sdpa
    assert greedy(model, prompt, 32, caches) == rebuilt
    # a plain KVCache goes through the routed name to mlx-lm's own function, unchanged
    plain = greedy(model, prompt, 16, [KVCache() for _ in model.layers])
    assert unroute_attention(model) is True
    assert qwen3.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    assert greedy(model, prompt, 16, [KVCache() for _ in model.layers]) == plain
    assert unroute_attention(model) is False


def test_uninstall_unroutes_and_a_model_without_layers_is_not_routed():
    model = make_tiny_qwen3(seed=4)
    KVCacheBuilder.install(model, KVCacheConfig(method="palu", head_dim=D))
    assert qwen3.scaled_dot_product_attention is routed_sdpa
    KVCacheBuilder.uninstall(model)
    assert qwen3.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    assert route_attention(object()) is False


class _ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


@pytest.mark.parametrize("sinks", [0, 4], ids=["no-exact-tokens", "4-sinks-20-newest"])
def test_calibrated_cache_equals_rebuild_then_sdpa(tmp_path, sinks):
    from palu_mlx.calibration import calibrate

    model = make_tiny_qwen3(seed=5)
    path = tmp_path / "tiny.safetensors"
    calibrate(model, _ByteTokenizer(), window=64, max_tokens=192, progress=False).save(path)
    config = KVCacheConfig(
        head_dim=D,
        palu_calibration=str(path),
        palu_bits=2.0,
        palu_sink_tokens=sinks,
        palu_recent_tokens=5 * sinks,
    )
    cache = KVCacheBuilder.for_model(model, config)[0]
    assert cache.latent_store() is None  # empty
    # the default calibration is attention-weighted: values leave the latent domain through its decoder
    assert (
        cache.source.value.projection.decoder is not None and cache.source.key.projection.decoder is not None
    )
    keys = planted_lowrank((2, 4, 70, D), rank=6, seed=8, noise=0.05)
    cache.update_and_fetch(keys, keys * 0.5 + 1.0)
    q = mx.random.normal((2, 8, 5, D), key=mx.random.key(9))
    got = latent_attention(q, cache.latent_store(), 0.2, "causal", chunk=32)
    assert rel_err(got, reference(q, cache, 0.2, "causal")) < TOL
