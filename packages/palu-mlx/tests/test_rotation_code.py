"""The data-free rotation code of short sliding windows: what it is, where the builder uses it,
what it holds and how close it stays."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvspec import KVConfigError, KVShapeError
from mlx_lm.models.cache import load_prompt_cache as mlx_load_prompt_cache
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.cache import save_prompt_cache as mlx_save_prompt_cache
from palu_helpers import reachable_nbytes
from palu_mlx import KVCacheBuilder, KVCacheConfig, PaluKVCache, RotatingPaluKVCache
from palu_mlx.rotation_code import (
    FIT_WINDOW_PER_DIM,
    ROTATION_BITS,
    RotationKVCache,
    fits_window,
    orthonormal_rotation,
    rotation_bits,
    rotation_code,
    window_config,
)
from test_pre_rope_families import COMMON, build_family

#: a tiny gemma3: a sliding layer of window 16 (heads of 32) beside a full-attention one
GEMMA = {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16, "sliding_window_pattern": 2}

#: the fitted cache's default config: its short windows take the rotation code
PALU = KVCacheConfig(method="palu")


@pytest.mark.parametrize("dim", [64, 128, 96])
def test_the_rotation_is_orthonormal_and_a_hadamard_matrix_for_powers_of_two(dim):
    r = orthonormal_rotation(dim).astype(np.float64)
    assert np.allclose(r @ r.T, np.eye(dim), atol=1e-5)
    if dim & (dim - 1) == 0:
        assert np.allclose(np.abs(r), 1 / np.sqrt(dim))  # every channel spread over every other
    assert np.array_equal(orthonormal_rotation(dim), orthonormal_rotation(dim))  # data-free, fixed


def test_bad_dims_and_bits_are_refused():
    for bad in (0, -4, 2.5, True):
        with pytest.raises(KVConfigError, match="dim"):
            orthonormal_rotation(bad)
    with pytest.raises(KVConfigError, match="bits"):
        rotation_code(2, 64, 9)


def test_the_code_round_trips_within_a_four_bit_error_and_holds_a_row_in_d_half_bytes():
    code = rotation_code(2, 64)
    x = mx.random.normal((1, 2, 50, 64), key=mx.random.key(1)) * 3
    latents = (x - code.projection.mean.astype(mx.float32)[None, :, None]) @ code.projection.basis.astype(
        mx.float32
    )
    rows = code.coder.encode(latents)
    assert rows.shape[-1] == 64 * ROTATION_BITS // 8 + 2  # the codes and a 16-bit scale per token
    back = code.coder.decode(rows) @ code.projection.basis.astype(mx.float32).swapaxes(-1, -2)
    rel = float((mx.linalg.norm(back - x) / mx.linalg.norm(x)).item())
    # a step of max|x| / 8 for 16 levels: about 0.3 standard deviations, an error of 0.087 of a row
    assert rel < 0.1


def test_short_windows_take_the_rotation_code_long_ones_a_fitted_projection():
    assert not fits_window(FIT_WINDOW_PER_DIM * 64 - 1, 64) and fits_window(FIT_WINDOW_PER_DIM * 64, 64)
    cfg = window_config(PALU, 128, 0)
    assert (cfg.palu_sink_tokens, cfg.palu_recent_tokens) == (0, 8)
    model = build_family("gemma3_text", COMMON, GEMMA)
    caches = KVCacheBuilder.for_model(model, PALU)
    sliding, full = caches[0], caches[1]
    assert type(sliding) is RotatingPaluKVCache and type(sliding.cache) is RotationKVCache
    assert type(full) is PaluKVCache
    # the codes are built from the first update, one rotation for every layer, keys and values
    model(mx.array([list(range(3, 40))]), cache=caches)
    shared = rotation_code(*_heads_dim(model)).projection
    assert sliding.cache._key_proj.basis is sliding.cache._value_proj.basis is shared.basis


def _heads_dim(model):
    from palu_mlx.models import model_kv_dims

    head_dim, heads = model_kv_dims(model)
    return heads, head_dim


def test_a_short_window_stays_close_to_mlx_lm_and_saves_and_loads(tmp_path):
    model = build_family("gemma3_text", COMMON, GEMMA)
    prompt = mx.array(list(range(3, 90)))
    ours, theirs = KVCacheBuilder.for_model(model, PALU), make_prompt_cache(model)
    a = model(prompt[None], cache=ours)[0, -1].astype(mx.float32)
    b = model(prompt[None], cache=theirs)[0, -1].astype(mx.float32)
    p, q = mx.softmax(b), (a - mx.logsumexp(a)) - (b - mx.logsumexp(b))
    assert float(-(p * q).sum().item()) < 0.05  # KL of the last position's next-token distribution
    sliding = ours[0]
    assert sliding.cache.offset < sliding.offset  # rows left the window
    assert reachable_nbytes(sliding.cache._key_codes) < reachable_nbytes(theirs[0].keys) / 2
    mlx_save_prompt_cache(str(tmp_path / "c.safetensors"), ours)
    loaded = mlx_load_prompt_cache(str(tmp_path / "c.safetensors"))
    nxt = mx.array([[5]])
    assert mx.allclose(model(nxt, cache=loaded), model(nxt, cache=ours), atol=1e-4).item()


def test_the_means_are_fitted_on_the_first_update_and_kept_with_the_state():
    model = build_family("gemma3_text", COMMON, GEMMA)
    caches = KVCacheBuilder.for_model(model, PALU)
    inner = caches[0].cache
    shared = rotation_code(*_heads_dim(model)).projection
    bad = mx.zeros((1, 2, 3, 5))  # a head dim the code cannot take
    with pytest.raises(KVShapeError):
        inner.update_and_fetch(bad, bad)
    assert inner._key_proj is None and inner.offset == 0  # nothing built by a refused update
    model(mx.array([list(range(3, 40))]), cache=caches)
    assert inner._key_proj.basis is shared.basis  # the rotation stays the shared one
    assert float(mx.abs(inner._key_proj.mean.astype(mx.float32)).max().item()) > 0
    assert inner.nbytes > 0 and any(a is inner._key_proj.mean for a in inner.held_arrays())
    loaded = RotationKVCache.from_state(inner.state, inner.meta_state)
    assert mx.array_equal(loaded._key_proj.mean, inner._key_proj.mean).item()
    assert mx.array_equal(loaded._value_proj.mean, inner._value_proj.mean).item()


def test_method_rotation_is_checked_where_it_is_given():
    assert KVCacheConfig(method="rotation").method == "rotation"
    assert KVCacheConfig(method="rotation", palu_bits=3).palu_bits == 3
    assert rotation_bits(KVCacheConfig(method="rotation", palu_bits=3.5)) == (4, 3)  # keys the bit above
    for bad, match in (
        (dict(palu_bits=4.25), "palu_bits"),
        (dict(palu_bits=8.5), "palu_bits"),
        (dict(palu_token_scale=False), "palu_token_scale"),
        (dict(palu_bits=1), "palu_bits"),
        (dict(palu_rank=8), "palu_rank"),
        (dict(palu_calibration="cal.safetensors"), "palu_calibration"),
    ):
        with pytest.raises(KVConfigError, match=match):
            KVCacheConfig(method="rotation", **bad)
    # without a model the codes are built from the first update
    assert type(KVCacheBuilder.make_layer_cache(KVCacheConfig(method="rotation"))) is RotationKVCache


@pytest.mark.parametrize("bits", [4, 8])
def test_method_rotation_codes_every_layer_of_a_model(bits, tmp_path):
    from mlx_lm.generate import generate_step
    from palu_helpers import make_tiny_qwen3

    model = make_tiny_qwen3()
    # ids inside the tiny model's 256-word vocabulary: MLX does not bounds-check the embedding
    # gather, so an id past it reads whatever memory follows the table
    prompt = mx.array([3 + i % 253 for i in range(297)])
    ours = KVCacheBuilder.for_model(model, KVCacheConfig(method="rotation", palu_bits=bits))
    assert all(type(c) is RotationKVCache for c in ours)
    assert ours[0].rotary is not None  # keys coded before RoPE, as palu's
    theirs = make_prompt_cache(model)
    model(prompt[None, :-1], cache=ours)
    model(prompt[None, :-1], cache=theirs)
    # codes, scales, means and the exact tokens over a float32 cache: measured 0.22 and 0.35
    held = reachable_nbytes(ours) / reachable_nbytes(theirs)
    assert held < (0.25 if bits == 4 else 0.4), held
    # the next token's distribution: KL measured 1.9e-3 at 4 bits and 8.9e-6 at 8
    p = mx.softmax(model(prompt[None, -1:], cache=theirs)[0, -1].astype(mx.float32))
    q = mx.softmax(model(prompt[None, -1:], cache=ours)[0, -1].astype(mx.float32))
    kl = mx.sum(p * (mx.log(p) - mx.log(q))).item()
    assert kl < (0.01 if bits == 4 else 1e-4), kl
    for _ in generate_step(mx.array([5, 6]), model, max_tokens=3, prompt_cache=ours):
        pass
    mlx_save_prompt_cache(str(tmp_path / "r.safetensors"), ours)
    loaded = mlx_load_prompt_cache(str(tmp_path / "r.safetensors"))
    assert type(loaded[0]) is RotationKVCache and loaded[0].offset == ours[0].offset
    nxt = mx.array([[7]])
    assert mx.allclose(model(nxt, cache=loaded), model(nxt, cache=ours), atol=1e-4).item()


def test_method_rotation_bounds_every_layer_under_max_kv_size():
    from mlx_lm.generate import generate_step
    from palu_helpers import make_tiny_qwen3

    model = make_tiny_qwen3()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="rotation"), max_kv_size=64)
    assert all(type(c) is RotatingPaluKVCache and type(c.cache) is RotationKVCache for c in caches)
    for _ in generate_step(mx.array(list(range(3, 200))), model, max_tokens=50, prompt_cache=caches):
        pass
    assert caches[0].offset == 247 and caches[0].cache.offset <= 64 - 1 + caches[0].slack


@pytest.mark.parametrize(("bits", "bound"), [(4, 0.1), (8, 0.01)])
def test_a_rotation_cache_gives_back_its_rows_within_its_bits(bits, bound):
    from palu_mlx.rotation_code import rotation_cache

    config = KVCacheConfig(method="rotation", palu_bits=bits, palu_sink_tokens=0, palu_recent_tokens=0)
    cache = rotation_cache(config, 2, 32, 32, None)
    g = mx.random.normal((1, 2, 120, 32), key=mx.random.key(3)) + mx.linspace(-3, 3, 32)  # channel offsets
    v = mx.random.normal((1, 2, 120, 32), key=mx.random.key(4))
    cache.update_and_fetch(g[..., :100, :], v[..., :100, :])  # the means come from this prefill
    keys, values = cache.update_and_fetch(g[..., 100:, :], v[..., 100:, :])
    for got, want in ((keys, g), (values, v)):
        assert float((mx.linalg.norm(got - want) / mx.linalg.norm(want)).item()) < bound
