"""The packed path of latent attention: fixed quantizers' rows unpacked by attention itself.

It must read exactly the codes the coder wrote, and give what the latents path and
rebuild-then-SDPA give (up to float32 rounding) for every RoPE layout, head grouping, exact-token
setting, batch, chunking and mask."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from palu_helpers import planted_lowrank, rel_err
from palu_mlx import KVCacheConfig, PaluKVCache
from palu_mlx.attention import PackedRows, _unpack, _unpacking, latent_attention
from palu_mlx.coders.fixed import FixedQuantCoder
from palu_mlx.rope import Rotary

D = 32
TOL = 2e-5  # float32 everywhere: the paths differ in summation order and where steps are applied


def rotary(dims: int = D, traditional: bool = False) -> Rotary:
    inv_freq = mx.array(10000.0 ** (-np.arange(0, dims, 2) / dims), dtype=mx.float32)
    return Rotary(inv_freq, dims, traditional)


def filled(config: KVCacheConfig, rope: Rotary | None, batch: int = 1, tokens: int = 100) -> PaluKVCache:
    cache = PaluKVCache(config, rotary=rope)
    keys = planted_lowrank((batch, 4, tokens, D), rank=6, seed=1, noise=0.05)
    values = planted_lowrank((batch, 4, tokens, D), rank=5, seed=2, noise=0.05)
    cache.update_and_fetch(keys[..., :40, :], values[..., :40, :])  # fits on the first 40
    cache.update_and_fetch(keys[..., 40:, :], values[..., 40:, :])
    return cache


def reference(queries, cache: PaluKVCache, scale, mask):
    keys, values = cache._fetch()
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


CONFIGS = {
    "2bit-per-head": KVCacheConfig(method="palu", head_dim=D, palu_bits=2.0, palu_n_head_groups=4),
    "2bit-two-groups": KVCacheConfig(method="palu", head_dim=D, palu_bits=2.0, palu_n_head_groups=2),
    "default-tier": KVCacheConfig(
        method="palu", head_dim=D
    ),  # 2.5 bits, token scale, 4 sinks, 32 newest exact
    "3bit-scale-no-window": KVCacheConfig(
        head_dim=D, palu_bits=3.0, palu_token_scale=True, palu_sink_tokens=0, palu_recent_tokens=0
    ),
}
ROPES = {
    "none": None,
    "half-split": rotary(),
    "traditional": rotary(traditional=True),
    "partial-dims": rotary(dims=16),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
@pytest.mark.parametrize("chunk", [16, 1024], ids=["chunked", "one-chunk"])
def test_packed_equals_latents_and_rebuild_then_sdpa(config, rope, chunk):
    cache = filled(config, rope, batch=2)
    store = cache.latent_store()
    assert store.packed_keys is not None and store.packed_values is not None
    for n_q, mask in ((1, None), (9, "causal")):
        q = mx.random.normal((2, 8, n_q, D), key=mx.random.key(n_q))
        packed = latent_attention(q, store, 0.17, mask, chunk=chunk)  # the default when rows are there
        assert mx.array_equal(packed, latent_attention(q, store, 0.17, mask, chunk=chunk, packed=True)).item()
        latents = latent_attention(q, store, 0.17, mask, chunk=chunk, packed=False)
        want = reference(q, cache, 0.17, mask)
        assert rel_err(packed, want) < TOL
        assert rel_err(packed, latents) < TOL


def test_packed_path_reads_no_latents_and_masks_like_sdpa():
    cache = filled(CONFIGS["default-tier"], rotary(), tokens=90)
    store = cache.latent_store()

    def refuse(start, stop):
        raise AssertionError("the packed path must not decode latents")

    spied = replace(store, key_latents=refuse, value_latents=refuse)
    q = mx.random.normal((1, 8, 7, D), key=mx.random.key(3))
    keep = mx.random.uniform(shape=(1, 8, 7, 90), key=mx.random.key(4)) > 0.4
    keep[..., 0] = True
    for mask in (keep, mx.where(keep, 0.0, -float("inf"))):
        got = latent_attention(q, spied, 0.2, mask, chunk=32)
        assert mx.all(mx.isfinite(got)).item()
        assert rel_err(got, reference(q, cache, 0.2, keep)) < TOL


def bits_reference(rows: np.ndarray, widths: tuple[int, ...], lead: int) -> np.ndarray:
    """Codes read bit by bit (little-endian within each byte, channels back to back)."""
    bits = np.unpackbits(rows[..., lead:], axis=-1, bitorder="little").astype(np.int64)
    out, at = [], 0
    for w in widths:
        out.append((bits[..., at : at + w] * (1 << np.arange(w))).sum(axis=-1))
        at += w
    return np.stack(out, axis=-1)


@pytest.mark.parametrize("token_scale", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unpack_reads_exactly_the_codes_the_coder_wrote(token_scale, seed):
    rng = np.random.default_rng(seed)
    widths = tuple(int(w) for w in rng.integers(1, 9, size=int(rng.integers(3, 40))))
    steps = mx.array(rng.uniform(0.1, 2.0, size=(3, len(widths))).astype(np.float32))
    coder = FixedQuantCoder(widths, steps, token_scale)
    latents = mx.array(rng.normal(size=(2, 3, 57, len(widths))).astype(np.float32) * 3)
    rows = coder.encode(latents)
    packed = PackedRows(rows, widths, steps, token_scale)
    codes, scale = _unpack(rows, _unpacking(packed))
    lead = 2 if token_scale else 0
    want = bits_reference(np.array(rows), widths, lead)
    assert np.array_equal(np.array(codes).astype(np.int64), want)
    # the codes, offsets, steps and scales give the coder's own latents
    offset = 0.5 - (1 << np.array(widths)) / 2.0
    rebuilt = (np.array(codes) + offset) * np.array(steps)[None, :, None, :]
    if token_scale:
        rebuilt = rebuilt * np.array(scale)
    else:
        assert scale is None
    np.testing.assert_allclose(rebuilt, np.array(coder.decode(rows)), rtol=1e-6, atol=1e-6)


def test_far_positions_rotate_like_the_model():
    """Keys thousands of tokens in: the tables (float64 angles, split as chunk start plus offset)
    against the reference's RoPE (float32 angles) stay within the same bound."""
    config = KVCacheConfig(method="palu", head_dim=D, palu_bits=3.0, palu_sink_tokens=0, palu_recent_tokens=0)
    cache = filled(config, rotary(), tokens=4200)
    q = mx.random.normal((1, 8, 1, D), key=mx.random.key(8))
    packed = latent_attention(q, cache.latent_store(), 0.2, None)
    latents = latent_attention(q, cache.latent_store(), 0.2, None, packed=False)
    want = reference(q, cache, 0.2, None)
    assert rel_err(latents, want) < TOL
    assert rel_err(packed, want) < TOL


def test_packed_argument_checks():
    cache = filled(CONFIGS["2bit-per-head"].replace(palu_bits=None, palu_hi_bit=4), rotary())
    store = cache.latent_store()  # the reference's mixed-bit coder: no packed rows
    assert store.packed_keys is None
    q = mx.random.normal((1, 8, 1, D), key=mx.random.key(9))
    with pytest.raises(ValueError, match="packed=True"):
        latent_attention(q, store, 0.2, None, packed=True)
    with pytest.raises(TypeError, match="packed="):
        latent_attention(q, store, 0.2, None, packed="yes")
    for chunk in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk="):
            latent_attention(q, store, 0.2, None, chunk=chunk)
    fixed = filled(CONFIGS["2bit-per-head"], rotary()).latent_store()
    bad = replace(fixed.packed_keys, widths=fixed.packed_keys.widths + (8, 8))  # two bytes more
    with pytest.raises(ValueError, match="packed rows of"):
        latent_attention(q, replace(fixed, packed_keys=bad), 0.2, None)
