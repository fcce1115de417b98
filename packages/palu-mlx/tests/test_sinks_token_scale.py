"""The two coder options for real models' K/V: a per-token scale beside the fixed quantizers
(``palu_token_scale``) and the first tokens held exactly (``palu_sink_tokens``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvspec import KVConfigError, KVDataError, KVValueError
from palu_helpers import make_tiny_qwen3, planted_lowrank, rel_err
from palu_mlx import (
    CalibratedKVCache,
    FixedQuantCoder,
    KVCacheBuilder,
    KVCacheConfig,
    PaluKVCache,
    load_prompt_cache,
    save_prompt_cache,
)
from palu_mlx.calibration import calibrate
from palu_mlx.coders.fixed import GAUSSIAN_STEP, TOKEN_SCALE_BYTES
from palu_mlx.rope import Rotary

D = 32


def rotary() -> Rotary:
    return Rotary(mx.array(10000.0 ** (-np.arange(0, D, 2) / D), dtype=mx.float32), D, False)


def kv(tokens: int, batch: int = 1, dtype=mx.float32, seed: int = 1):
    keys = planted_lowrank((batch, 2, tokens, D), rank=6, seed=seed, noise=0.05, dtype=dtype)
    values = planted_lowrank((batch, 2, tokens, D), rank=5, seed=seed + 1, noise=0.05, dtype=dtype)
    return keys, values


# ---------------------------------------------------------------- token scale
@pytest.mark.parametrize("widths", [(1,), (8, 8), (3, 5, 7, 1, 2), (4,) * 9], ids=str)
def test_token_scale_row_holds_codes_and_a_bfloat16_scale(widths):
    steps = mx.array(np.full((2, len(widths)), 0.1, np.float32))
    coder = FixedQuantCoder(widths, steps, token_scale=True)
    assert coder.bytes_per_row == -(-sum(widths) // 8) + TOKEN_SCALE_BYTES
    x = mx.random.normal((1, 2, 7, len(widths)), key=mx.random.key(0)) * 0.2
    packed = coder.encode(x)
    assert packed.dtype == mx.uint8 and packed.shape == (1, 2, 7, coder.bytes_per_row)
    scale = np.array(mx.contiguous(packed[..., :TOKEN_SCALE_BYTES]).view(mx.bfloat16).astype(mx.float32))
    decoded = np.array(coder.decode(packed))
    # every channel of 2 bits or more lands within half a (scaled) step: nothing clips
    wide = np.array(widths) >= 2
    half_step = 0.05 * scale
    assert np.all(np.abs(decoded - np.array(x))[..., wide] <= half_step * 1.0001 + 1e-7)


def test_token_scale_follows_an_outlier_token_that_fixed_ranges_clip():
    widths = (4,) * 8
    steps = mx.array(np.full((1, 8), GAUSSIAN_STEP[4], np.float32))  # unit-variance channels
    x = mx.random.normal((1, 1, 64, 8), key=mx.random.key(3))
    x[..., 0, :] = x[..., 0, :] * 8.0  # one token at 8 standard deviations (an attention sink)
    fixed, scaled = FixedQuantCoder(widths, steps), FixedQuantCoder(widths, steps, token_scale=True)
    outlier = x[..., :1, :]
    assert rel_err(scaled.decode(scaled.encode(outlier)), outlier) < 0.1
    assert rel_err(fixed.decode(fixed.encode(outlier)), outlier) > 0.3  # clipped at about 2.7
    typical = x[..., 1:, :]
    assert rel_err(scaled.decode(scaled.encode(typical)), typical) < 0.15


def test_token_scale_rejects_a_non_bool():
    with pytest.raises(KVConfigError, match="token_scale='yes'"):
        FixedQuantCoder((2,), mx.ones((1, 1)), token_scale="yes")
    with pytest.raises(KVConfigError, match="palu_token_scale=1"):
        KVCacheConfig(palu_token_scale=1)


def test_all_zero_tokens_decode_to_zero():
    coder = FixedQuantCoder((3, 2), mx.ones((1, 2)), token_scale=True)
    out = coder.decode(coder.encode(mx.zeros((1, 1, 2, 2))))
    assert float(mx.abs(out).max()) < 1e-3 and bool(mx.all(mx.isfinite(out)).item())


# ---------------------------------------------------------------- sinks
@pytest.mark.parametrize("pre_rope", [True, False], ids=["pre-rope", "post-rope"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_first_tokens_are_returned_exactly_and_counted(pre_rope, dtype):
    keys, values = kv(90, batch=2, dtype=dtype)
    config = KVCacheConfig(head_dim=D, palu_bits=1.5, palu_sink_tokens=4, palu_token_scale=True)
    with_sinks = PaluKVCache(config, rotary=rotary() if pre_rope else None)
    without = PaluKVCache(KVCacheConfig(head_dim=D, palu_bits=1.5, palu_token_scale=True, palu_sink_tokens=0))
    for cache in (with_sinks, without):
        cache.update_and_fetch(keys[..., :40, :], values[..., :40, :])
        k_out, v_out = cache.update_and_fetch(keys[..., 40:, :], values[..., 40:, :])
    k_out, v_out = with_sinks._fetch()
    assert mx.array_equal(k_out[..., :4, :], keys[..., :4, :]).item()
    assert mx.array_equal(v_out[..., :4, :], values[..., :4, :]).item()
    assert not mx.array_equal(k_out[..., 4:8, :], keys[..., 4:8, :]).item()  # the rest is coded
    # measured: the exact rows are held arrays, 4 tokens of keys and values in the input dtype
    assert with_sinks.nbytes == sum(a.nbytes for a in with_sinks.held_arrays())
    if not pre_rope:
        assert with_sinks.nbytes - without.nbytes == 2 * 2 * 4 * 2 * D * dtype.size


def test_sinks_survive_save_load_and_trim():
    keys, values = kv(80)
    config = KVCacheConfig(head_dim=D, palu_bits=2.0, palu_sink_tokens=4, palu_token_scale=True)
    cache = PaluKVCache(config, rotary=rotary())
    cache.update_and_fetch(keys[..., :40, :], values[..., :40, :])
    cache.update_and_fetch(keys[..., 40:, :], values[..., 40:, :])
    state = cache.state
    assert state["sink.keys"].shape == (1, 2, 4, D)
    restored = PaluKVCache.from_state(state, cache.meta_state)
    for a, b in zip(restored._fetch(), cache._fetch(), strict=True):
        assert mx.array_equal(a, b).item()
    assert restored.nbytes == sum(a.nbytes for a in restored.held_arrays())
    # trimmed back to 2 tokens, then new tokens at positions 2.. are held exactly in their place
    restored.trim(78)
    new_k, new_v = kv(6, seed=7)
    k_out, v_out = restored.update_and_fetch(new_k, new_v)
    assert k_out.shape[2] == 8
    assert mx.array_equal(k_out[..., 2:4, :], new_k[..., :2, :]).item()
    assert mx.array_equal(v_out[..., :2, :], values[..., :2, :]).item()
    assert set(restored.state) >= {"sink.keys", "sink.values"}


def test_a_rejected_update_leaves_sinks_unchanged():
    keys, values = kv(50)
    cache = PaluKVCache(KVCacheConfig(head_dim=D, palu_bits=2.0, palu_sink_tokens=4, palu_min_fit_tokens=2))
    cache.update_and_fetch(keys[..., :2, :], values[..., :2, :])
    before = {k: np.array(v) for k, v in cache.state.items()}
    bad = keys[..., 2:5, :] * mx.array(float("nan"))
    with pytest.raises(KVValueError):
        cache.update_and_fetch(bad, values[..., 2:5, :])
    after = cache.state
    assert set(after) == set(before) and all(np.array_equal(before[k], np.array(after[k])) for k in before)


@pytest.mark.parametrize("value", [-1, True, 2.0, "4"])
def test_sink_tokens_must_be_a_non_negative_int(value):
    with pytest.raises(KVConfigError, match="palu_sink_tokens"):
        KVCacheConfig(palu_sink_tokens=value)


class _ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def test_calibrated_cache_with_sinks_and_token_scale_generates_saves_and_loads(tmp_path):
    model = make_tiny_qwen3(seed=2)
    path = str(tmp_path / "tiny.safetensors")
    calibrate(model, _ByteTokenizer(), window=64, max_tokens=192, progress=False).save(path)
    config = KVCacheConfig(
        head_dim=D, palu_calibration=path, palu_bits=2.0, palu_sink_tokens=4, palu_token_scale=True
    )
    caches = KVCacheBuilder.for_model(model, config)
    assert all(isinstance(c, CalibratedKVCache) for c in caches)
    prompt = mx.array(list(range(3, 50)))
    model(prompt[None], cache=caches)
    layer = caches[0]
    assert layer._key_codes["codes"].shape[-1] == layer.source.key.coder.code_bytes + TOKEN_SCALE_BYTES
    assert layer.nbytes == sum(a.nbytes for a in layer.held_arrays())
    file = str(tmp_path / "cache.safetensors")
    save_prompt_cache(file, caches)
    loaded = load_prompt_cache(file)
    for a, b in zip(loaded[0]._fetch(), layer._fetch(), strict=True):
        assert mx.array_equal(a, b).item()
    out_a = model(mx.array([[5]]), cache=loaded)
    out_b = model(mx.array([[5]]), cache=caches)
    assert mx.allclose(out_a, out_b, atol=1e-4).item()


def test_a_row_of_one_bit_channels_keeps_its_fixed_steps():
    steps = mx.array(np.full((1, 3), GAUSSIAN_STEP[1], np.float32))
    x = mx.random.normal((1, 1, 16, 3), key=mx.random.key(4))
    scaled, fixed = FixedQuantCoder((1, 1, 1), steps, token_scale=True), FixedQuantCoder((1, 1, 1), steps)
    assert mx.array_equal(scaled.decode(scaled.encode(x)), fixed.decode(fixed.encode(x))).item()


# ---------------------------------------------------------------- the newest tokens exact
@pytest.mark.parametrize("sinks", [0, 4], ids=["no-sinks", "4-sinks"])
def test_newest_tokens_are_returned_exactly_as_they_slide(sinks):
    keys, values = kv(120)
    config = KVCacheConfig(head_dim=D, palu_bits=2.0, palu_sink_tokens=sinks, palu_recent_tokens=16)
    cache = PaluKVCache(config, rotary=rotary())
    cache.update_and_fetch(keys[..., :40, :], values[..., :40, :])
    for start in range(40, 120, 7):  # decode-sized and chunk-sized appends
        k_out, v_out = cache.update_and_fetch(
            keys[..., start : start + 7, :], values[..., start : start + 7, :]
        )
        n = cache.offset
        assert mx.array_equal(k_out[..., n - 16 :, :], keys[..., n - 16 : n, :]).item()
        assert mx.array_equal(v_out[..., n - 16 :, :], values[..., n - 16 : n, :]).item()
        # older tokens come from their codes
        assert not mx.array_equal(v_out[..., n - 24 : n - 16, :], values[..., n - 24 : n - 16, :]).item()
    window = cache._recent
    assert window.keys.shape[2] == 16 and window.start == 104
    assert cache.nbytes == sum(a.nbytes for a in cache.held_arrays())
    store = cache.latent_store()
    assert store.recent_start == 104 and store.coded_stop == 104


def test_window_state_round_trips_through_trim_and_save():
    keys, values = kv(100)
    config = KVCacheConfig(head_dim=D, palu_bits=2.0, palu_recent_tokens=16)
    cache = PaluKVCache(config, rotary=rotary())
    cache.update_and_fetch(keys[..., :64, :], values[..., :64, :])
    cache.update_and_fetch(keys[..., 64:, :], values[..., 64:, :])
    for trim in (0, 5, 30):  # inside the window, and back past its start
        copy = PaluKVCache.from_state(cache.state, cache.meta_state)
        copy.trim(trim)
        again = PaluKVCache.from_state(copy.state, copy.meta_state)
        for a, b in zip(again._fetch(), copy._fetch(), strict=True):
            assert mx.array_equal(a, b).item()
        new_k, new_v = kv(3, seed=11)
        k_out, _ = again.update_and_fetch(new_k, new_v)
        assert mx.array_equal(k_out[..., -3:, :], new_k).item()


def test_window_state_with_a_bad_start_is_refused():
    keys, values = kv(80)
    cache = PaluKVCache(KVCacheConfig(head_dim=D, palu_bits=2.0, palu_recent_tokens=8), rotary=rotary())
    cache.update_and_fetch(keys, values)
    config_json, runtime = cache.meta_state
    import json

    bad = json.loads(runtime)
    bad["recent_start"] = 10  # 70 tokens: more than the window holds
    with pytest.raises(KVDataError, match="recent_start=10"):
        PaluKVCache.from_state(cache.state, (config_json, json.dumps(bad)))


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_recent_tokens_must_be_a_non_negative_int(value):
    with pytest.raises(KVConfigError, match="palu_recent_tokens"):
        KVCacheConfig(palu_recent_tokens=value)


def test_a_state_without_these_options_is_refused_not_read_with_defaults():
    import json

    keys, values = kv(60)
    old = KVCacheConfig(
        head_dim=D, palu_bits=2.0, palu_token_scale=False, palu_sink_tokens=0, palu_recent_tokens=0
    )
    cache = PaluKVCache(old)
    cache.update_and_fetch(keys, values)
    config_json, runtime = cache.meta_state
    restored = PaluKVCache.from_state(cache.state, (config_json, runtime))
    assert restored.config == old
    for a, b in zip(restored._fetch(), cache._fetch(), strict=True):
        assert mx.array_equal(a, b).item()
    settings = json.loads(config_json)
    for name in ("palu_token_scale", "palu_sink_tokens", "palu_recent_tokens"):
        del settings[name]
    with pytest.raises(
        KVDataError, match="lacks the keywords .'palu_recent_tokens', 'palu_sink_tokens', 'palu_token_scale'."
    ):
        PaluKVCache.from_state(cache.state, (json.dumps(settings), runtime))
