"""PaluKVCache behaviour: storage, fit timing, mlx-lm interface, bytes, dtypes, errors; the naive baseline."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvspec import KVConfigError, KVDtypeError, KVShapeError, KVTrimError, KVValueError
from palu_helpers import gaussian, planted_lowrank, rel_err
from palu_mlx import FixedQuantCoder, KVCacheConfig, NaiveQuantKVCache, PaluKVCache, naive_roundtrip
from palu_mlx.config import REFERENCE_SPLIT

D = 64


def make(**kw) -> PaluKVCache:
    kw.setdefault("head_dim", D)
    return PaluKVCache(KVCacheConfig(method="palu", **kw))


def held_arrays(cache: PaluKVCache) -> list[mx.array]:
    """Independent of cache.held_arrays(): walk the private buffers."""
    out = [cache._exact_keys, cache._exact_values]
    for proj in (cache._key_proj, cache._value_proj):
        if proj is not None:
            out += list(proj.arrays().values())
    for coder in (cache._key_coder, cache._value_coder):
        if isinstance(coder, FixedQuantCoder):  # the water-filling tiers' quantizers: per-channel steps
            out.append(coder.steps)
    for codes in (cache._key_codes, cache._value_codes):
        out += list((codes or {}).values())
    out += [cache._sinks.keys, cache._sinks.values]  # the exact first tokens, once written
    out += [cache._recent.keys, cache._recent.values]  # the exact newest tokens
    return [a for a in out if a is not None]


def snapshot(cache: PaluKVCache):
    # bf16 widens to fp32 exactly; numpy has no bf16.
    state = {
        k: np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v) for k, v in cache.state.items()
    }
    return cache.offset, cache.meta_state, state, cache.nbytes


# ----------------------------------------------------------------------------- storage and quality
def test_projections_stored_after_prefill():
    cache = make(palu_rank=8, palu_n_head_groups=4)
    k = planted_lowrank((1, 8, 80, D), 8, seed=1)
    cache.update_and_fetch(k, k)
    assert cache.fitted
    assert cache._key_proj.basis.shape == (4, D, 8)  # one V_g [D, r] per group
    assert cache._value_proj.mean.shape == (4, D)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_shape_and_dtype_preserved_on_prefill_and_decode(dtype):
    cache = make()
    k, v = gaussian((2, 4, 70, D), 1, dtype), gaussian((2, 4, 70, D), 2, dtype)
    keys, values = cache.update_and_fetch(k, v)
    assert keys.shape == (2, 4, 70, D) and keys.dtype == dtype and values.dtype == dtype
    keys, values = cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert keys.shape == (2, 4, 71, D) and values.dtype == dtype


def test_storage_is_latent_and_no_full_history_is_held():
    cache = make(palu_rank=16)
    k, v = gaussian((1, 4, 100, D), 1, mx.float16), gaussian((1, 4, 100, D), 2, mx.float16)
    cache.update_and_fetch(k, v)
    for _ in range(3):
        cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert cache._exact_keys is None and cache._exact_values is None
    assert not hasattr(cache, "keys") and not hasattr(cache, "values")
    for name, arr in {**cache._key_codes, **cache._value_codes}.items():
        assert arr.shape[:2] == (1, 4) and arr.shape[3] < 16, name  # [B, H, S, <r] packed rows
    # All per-token buffers of keys AND values together (at their 256-token capacity) are
    # smaller than the fp16 [S, D] history of the keys alone.
    token_bytes = sum(a.nbytes for a in {**cache._key_codes, **cache._value_codes}.values())
    assert token_bytes < cache.fp16_key_bytes


def test_planted_rank8_beats_naive_2bit_for_keys_and_values():
    k = planted_lowrank((1, 8, 256, D), 8, seed=1, dtype=mx.float16)
    v = planted_lowrank((1, 8, 256, D), 8, seed=2, dtype=mx.float16)
    cache = make(palu_rank=8)
    keys, values = cache.update_and_fetch(k, v)
    for x, x_hat in ((k, keys), (v, values)):
        naive, _ = naive_roundtrip(x, bits=2, group_size=64)
        palu_mse = mx.mean((x_hat.astype(mx.float32) - x.astype(mx.float32)) ** 2).item()
        naive_mse = mx.mean((naive.astype(mx.float32) - x.astype(mx.float32)) ** 2).item()
        assert palu_mse < naive_mse


def test_decode_accumulates_finite_output_and_offset_grows_by_steps():
    cache = make()
    k = gaussian((1, 4, 64, D), 1, mx.float16)
    cache.update_and_fetch(k, k)
    for step in range(1, 21):
        new = gaussian((1, 4, 1, D), 100 + step, mx.float16)
        keys, values = cache.update_and_fetch(new, new)
        assert cache.offset == 64 + step
    assert mx.all(mx.isfinite(keys)).item() and mx.all(mx.isfinite(values)).item()


def test_compressed_bytes_below_fp16_for_keys_and_values():
    cache = make()
    x = planted_lowrank((1, 8, 256, D), 12, seed=3, noise=0.05, dtype=mx.float16)
    cache.update_and_fetch(x, x)
    assert cache.compressed_key_bytes < cache.fp16_key_bytes
    assert cache.compressed_value_bytes < cache.fp16_value_bytes


def test_unquantized_values_keep_fp16_latents_and_still_compress():
    cache = make(palu_rank=16, palu_quantize_values=False)
    x = gaussian((1, 8, 256, D), 4, mx.float16)
    cache.update_and_fetch(x, x)
    assert set(cache._value_codes) == {"seg0.values"}
    assert cache._value_codes["seg0.values"].dtype == mx.float16
    assert cache._value_codes["seg0.values"].shape[-1] == 16
    assert any(a.dtype == mx.uint8 for a in cache._key_codes.values())  # keys still mixed-bit
    assert cache.compressed_value_bytes < cache.fp16_value_bytes


def test_assigned_avg_bits_below_two_with_the_reference_split():
    cache = make(**REFERENCE_SPLIT)
    x = planted_lowrank((1, 8, 128, D), 16, seed=5, noise=0.1, dtype=mx.float16)
    cache.update_and_fetch(x, x)
    assert cache.assigned_avg_bits < 2.0
    r = cache.key_rank
    n_hi = -(-r // 4)
    assert cache.assigned_avg_bits >= r / D * (4 * n_hi + 2 * (r - n_hi)) / r - 1e-9


def test_energy_threshold_rank_in_range():
    for threshold in (0.1, 0.9, 1.0):
        cache = make(palu_energy_threshold=threshold)
        x = gaussian((1, 4, 80, D), 6)
        cache.update_and_fetch(x, x)
        assert 1 <= cache.key_rank <= D and 1 <= cache.value_rank <= D


def test_deterministic():
    x = gaussian((2, 4, 90, D), 7, mx.float16)
    a, b = make(), make()
    out_a, out_b = a.update_and_fetch(x, x), b.update_and_fetch(x, x)
    assert mx.array_equal(out_a[0], out_b[0]).item() and mx.array_equal(out_a[1], out_b[1]).item()


# ----------------------------------------------------------------------------- fit timing
def test_short_prompt_stays_exact_until_min_tokens_then_fits_once():
    cache = make(palu_min_fit_tokens=32, palu_energy_threshold=0.9)
    x = planted_lowrank((1, 4, 40, D), 20, seed=8, dtype=mx.float16)
    keys, _ = cache.update_and_fetch(x[:, :, :1], x[:, :, :1])  # one-token prompt
    assert not cache.fitted and mx.array_equal(keys, x[:, :, :1]).item()
    for t in range(1, 31):
        keys, _ = cache.update_and_fetch(x[:, :, t : t + 1], x[:, :, t : t + 1])
        assert not cache.fitted
    assert mx.array_equal(keys, x[:, :, :31]).item()  # exact tokens, bitwise
    cache.update_and_fetch(x[:, :, 31:32], x[:, :, 31:32])
    assert cache.fitted and cache.key_rank > 2  # not a projection fixed by the first token
    basis = np.array(cache._key_proj.basis)
    cache.update_and_fetch(x[:, :, 32:40], x[:, :, 32:40])  # a later S>1 chunk: projected, not refit
    assert np.array_equal(np.array(cache._key_proj.basis), basis)


def test_default_minimum_is_head_dim_tokens():
    cache = make()
    x = gaussian((1, 4, D, D), 9, mx.float16)
    cache.update_and_fetch(x[:, :, : D - 1], x[:, :, : D - 1])
    assert not cache.fitted
    cache.update_and_fetch(x[:, :, D - 1 :], x[:, :, D - 1 :])
    assert cache.fitted


def test_positions_are_stable_after_the_fit():
    cache = make(palu_recent_tokens=0)
    x = gaussian((1, 4, 100, D), 10, mx.float16)
    first, _ = cache.update_and_fetch(x[:, :, :70], x[:, :, :70])
    for t in range(70, 100, 3):
        keys, values = cache.update_and_fetch(x[:, :, t : t + 3], x[:, :, t : t + 3])
        assert mx.array_equal(keys[:, :, :70], first).item()


def test_with_a_window_a_position_changes_once_when_it_leaves_it():
    cache = make(palu_recent_tokens=8)
    x = gaussian((1, 4, 100, D), 10, mx.float16)
    seen = [cache.update_and_fetch(x[:, :, :70], x[:, :, :70])[0]]
    for t in range(70, 100):
        seen.append(cache.update_and_fetch(x[:, :, t : t + 1], x[:, :, t : t + 1])[0])
    # token 80 is exact while among the newest 8 (steps 80..87), read from its codes after
    at = [s[:, :, 80] for s in seen[11:]]
    changes = [i for i in range(1, len(at)) if not mx.array_equal(at[i], at[i - 1]).item()]
    assert changes == [8] and mx.array_equal(at[0], x[:, :, 80]).item()


def test_buffers_grow_in_steps_not_per_token():
    cache = make(palu_min_fit_tokens=4)
    x = gaussian((1, 4, 4, D), 11, mx.float16)
    cache.update_and_fetch(x, x)
    capacities = set()
    for _ in range(600):
        cache.update_and_fetch(x[:, :, :1], x[:, :, :1])
        capacities.add(next(iter(cache._key_codes.values())).shape[2])
    assert capacities == {256, 512, 768}  # three allocations for 604 tokens


# ----------------------------------------------------------------------------- mlx-lm interface
def test_no_bits_attribute_and_mask():
    cache = make()
    assert not hasattr(cache, "bits")
    assert cache.empty() and cache.make_mask(1) is None
    x = gaussian((1, 4, 5, D), 12, mx.float16)
    cache.update_and_fetch(x, x)
    assert not cache.empty() and cache.make_mask(3) == "causal"
    mask = cache.make_mask(3, return_array=True)
    assert mask.shape == (3, 8)


def test_trim_before_and_after_fit():
    cache = make(palu_min_fit_tokens=16)
    x = gaussian((1, 4, 40, D), 13, mx.float16)
    cache.update_and_fetch(x[:, :, :10], x[:, :, :10])
    assert cache.is_trimmable() and cache.trim(4) == 4 and cache.offset == 6
    keys, _ = cache.update_and_fetch(x[:, :, 6:30], x[:, :, 6:30])
    assert cache.fitted and keys.shape[2] == 30
    assert cache.trim(100) == 30 and cache.offset == 0
    keys, _ = cache.update_and_fetch(x[:, :, :5], x[:, :, :5])
    assert keys.shape[2] == 5
    with pytest.raises(KVTrimError, match="n=-1"):
        cache.trim(-1)


def test_trimmed_then_refilled_equals_direct():
    x = gaussian((1, 4, 90, D), 14, mx.float16)
    a, b = make(), make()
    a.update_and_fetch(x[:, :, :80], x[:, :, :80])
    b.update_and_fetch(x[:, :, :80], x[:, :, :80])
    a.update_and_fetch(x[:, :, 80:85] * 2, x[:, :, 80:85] * 2)
    a.trim(5)
    out_a = a.update_and_fetch(x[:, :, 80:90], x[:, :, 80:90])
    out_b = b.update_and_fetch(x[:, :, 80:90], x[:, :, 80:90])
    assert mx.array_equal(out_a[0], out_b[0]).item() and mx.array_equal(out_a[1], out_b[1]).item()


@pytest.mark.parametrize("tokens", [0, 10, 100])
def test_state_round_trip_restores_an_identical_cache(tokens):
    cache = make(palu_min_fit_tokens=32)
    x = gaussian((2, 4, 110, D), 15, mx.bfloat16)
    if tokens:
        cache.update_and_fetch(x[:, :, :tokens], x[:, :, :tokens])
    restored = PaluKVCache.from_state(cache.state, cache.meta_state)
    (off_a, meta_a, state_a, _), (off_b, meta_b, state_b, _) = snapshot(cache), snapshot(restored)
    assert (off_a, meta_a) == (off_b, meta_b) and state_a.keys() == state_b.keys()
    assert all(
        state_a[k].dtype == state_b[k].dtype and np.array_equal(state_a[k], state_b[k]) for k in state_a
    )
    nxt = x[:, :, tokens : tokens + 3]
    out_a, out_b = cache.update_and_fetch(nxt, nxt), restored.update_and_fetch(nxt, nxt)
    assert mx.array_equal(out_a[0], out_b[0]).item() and mx.array_equal(out_a[1], out_b[1]).item()


# ----------------------------------------------------------------------------- bytes
def test_nbytes_is_the_sum_of_held_arrays():
    cache = make()
    assert cache.nbytes == 0
    x = gaussian((1, 4, 30, D), 16, mx.float16)
    cache.update_and_fetch(x, x)  # exact phase: the exact tail is counted
    assert cache.nbytes == sum(a.nbytes for a in held_arrays(cache)) == 2 * 4 * 256 * D * 2
    cache.update_and_fetch(gaussian((1, 4, 300, D), 17, mx.float16), gaussian((1, 4, 300, D), 18, mx.float16))
    assert cache.fitted
    assert cache.nbytes == sum(a.nbytes for a in held_arrays(cache))
    assert cache.compressed_key_bytes + cache.compressed_value_bytes == cache.nbytes
    assert cache.fp16_key_bytes == 4 * 330 * D * 2
    stats = cache.storage_stats()
    assert (stats.tokens, stats.nbytes, stats.raw_nbytes) == (330, cache.nbytes, 2 * 4 * 330 * D * 2)
    assert stats.bits_per_element == pytest.approx(8 * cache.nbytes / (2 * 4 * 330 * D))


# ----------------------------------------------------------------------------- B, GQA, dtypes
def test_batch_items_share_projections_and_are_reconstructed_separately():
    cache = make(palu_rank=D, palu_hi_bit=16, palu_lo_bit=16, palu_n_head_groups=2)
    x = gaussian((3, 2, 70, D), 19)
    keys, values = cache.update_and_fetch(x, x * 0.5)
    assert rel_err(keys, x) < 1e-5 and rel_err(values, x * 0.5) < 1e-5


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_full_rank_unquantized_is_near_lossless(dtype):
    cache = make(palu_rank=D, palu_hi_bit=16, palu_lo_bit=16, palu_min_fit_tokens=1)
    x = gaussian((1, 4, 50, D), 20, dtype)
    keys, _ = cache.update_and_fetch(x, x)
    tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]
    assert keys.dtype == dtype and rel_err(keys, x) < tol


# ----------------------------------------------------------------------------- errors
BAD_CALLS = {
    "rank3": (lambda: (mx.zeros((4, 3, D)), mx.zeros((4, 3, D))), KVShapeError),
    "kv_mismatch": (lambda: (mx.zeros((1, 4, 3, D)), mx.zeros((1, 4, 2, D))), KVShapeError),
    "head_dim": (lambda: (mx.zeros((1, 4, 3, 32)), mx.zeros((1, 4, 3, 32))), KVShapeError),
    "heads_changed": (lambda: (mx.zeros((1, 8, 3, D)), mx.zeros((1, 8, 3, D))), KVShapeError),
    "batch_changed": (lambda: (mx.zeros((2, 4, 3, D)), mx.zeros((2, 4, 3, D))), KVShapeError),
    "int_dtype": (lambda: (mx.zeros((1, 4, 3, D), mx.int32), mx.zeros((1, 4, 3, D), mx.int32)), KVDtypeError),
    "dtype_changed": (
        lambda: (mx.zeros((1, 4, 3, D), mx.float32), mx.zeros((1, 4, 3, D), mx.float32)),
        KVDtypeError,
    ),
    "kv_dtypes": (
        lambda: (mx.zeros((1, 4, 3, D), mx.float16), mx.zeros((1, 4, 3, D), mx.float32)),
        KVDtypeError,
    ),
    "nan": (
        lambda: (mx.full((1, 4, 3, D), float("nan"), mx.float16), mx.zeros((1, 4, 3, D), mx.float16)),
        KVValueError,
    ),
    "inf": (
        lambda: (mx.zeros((1, 4, 3, D), mx.float16), mx.full((1, 4, 3, D), float("inf"), mx.float16)),
        KVValueError,
    ),
    "numpy": (lambda: (np.zeros((1, 4, 3, D)), np.zeros((1, 4, 3, D))), KVDtypeError),
}


@pytest.mark.parametrize("fitted", [False, True], ids=["exact-phase", "latent-phase"])
@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_rejected_call_leaves_cache_unchanged(case, fitted):
    cache = make(palu_min_fit_tokens=8)
    x = gaussian((1, 4, 10 if fitted else 4, D), 21, mx.float16)
    cache.update_and_fetch(x, x)
    before = snapshot(cache)
    make_args, error = BAD_CALLS[case]
    with pytest.raises(error):
        cache.update_and_fetch(*make_args())
    after = snapshot(cache)
    assert after[:2] == before[:2] and after[3] == before[3]
    assert all(np.array_equal(after[2][k], before[2][k]) for k in before[2])


def test_heads_not_divisible_by_groups():
    cache = make(palu_n_head_groups=3)
    with pytest.raises(KVConfigError, match="palu_n_head_groups=3"):
        cache.update_and_fetch(mx.zeros((1, 4, 2, D)), mx.zeros((1, 4, 2, D)))
    assert cache.empty()


def test_method_must_be_palu():
    with pytest.raises(KVConfigError, match="method"):
        PaluKVCache(KVCacheConfig(method="naive", head_dim=D))


# ----------------------------------------------------------------------------- naive baseline
def test_naive_baseline_cache():
    cache = NaiveQuantKVCache(quant_bits=2, group_size=64)
    assert not hasattr(cache, "bits")
    x = gaussian((1, 4, 20, D), 22, mx.float16)
    keys, values = cache.update_and_fetch(x, x)
    assert keys.dtype == mx.float16 and keys.shape == x.shape
    expected, nbytes = naive_roundtrip(x, 2, 64)
    assert mx.array_equal(keys, expected).item()
    assert nbytes == 4 * 20 * (D * 2 // 8 + 2 * 2)
    restored = NaiveQuantKVCache.from_state(cache.state, cache.meta_state)
    assert mx.array_equal(restored.update_and_fetch(x, x)[0], cache.update_and_fetch(x, x)[0]).item()
    with pytest.raises(KVValueError):
        cache.update_and_fetch(x * float("inf"), x)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_quantized_latents_keep_16_bit_scales_and_projections(dtype):
    cache = make(palu_rank=16, palu_quantize_values=False)
    x = gaussian((1, 4, 70, D), 23, dtype)
    cache.update_and_fetch(x, x)
    compact = mx.bfloat16 if dtype == mx.bfloat16 else mx.float16
    assert cache._key_codes["seg0.scales"].dtype == compact and cache._key_proj.basis.dtype == compact
    # unquantized value latents keep the input dtype, and so does their projection
    assert cache._value_codes["seg0.values"].dtype == dtype and cache._value_proj.basis.dtype == dtype
