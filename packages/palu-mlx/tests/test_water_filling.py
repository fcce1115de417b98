"""Reverse water-filling: exact budgets, dropped channels, optimality, and the cache at ``palu_bits``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvspec import KVConfigError
from palu_helpers import planted_lowrank, rel_err
from palu_mlx import KVCacheConfig, PaluKVCache, Segment, WaterFillingPolicy, water_fill

SPECTRA = {
    "power-law": [np.arange(1, 65, dtype=float) ** -2.0],
    "geometric-k-and-v": [0.7 ** np.arange(64), 0.5 ** np.arange(64)],
    "six-layers": [np.random.default_rng(i).gamma(0.5, size=32) for i in range(6)],
    "flat": [np.ones(16)],
}


def distortion(lams, widths) -> float:
    return float(sum((lam * 4.0**-w).sum() for lam, w in zip(lams, widths, strict=True)))


@pytest.mark.parametrize("name", SPECTRA)
@pytest.mark.parametrize("bits_per_channel", [0.25, 1.0, 1.5, 3.0])
def test_spends_exactly_the_budget(name, bits_per_channel):
    lams = SPECTRA[name]
    budget = int(round(bits_per_channel * sum(lam.size for lam in lams)))
    widths = water_fill(lams, budget)
    assert sum(int(w.sum()) for w in widths) == budget
    assert all(w.min() >= 0 and w.max() <= 8 for w in widths)


@pytest.mark.parametrize("name", ["power-law", "geometric-k-and-v", "six-layers"])
def test_no_single_bit_move_lowers_the_error(name):
    lams = [np.asarray(lam, dtype=float) for lam in SPECTRA[name]]
    widths = water_fill(lams, int(1.5 * sum(lam.size for lam in lams)))
    best = distortion(lams, widths)
    flat = [(t, c) for t, w in enumerate(widths) for c in range(w.size)]
    for t1, c1 in flat:
        if widths[t1][c1] == 0:
            continue
        for t2, c2 in flat:
            if (t1, c1) == (t2, c2) or widths[t2][c2] == 8:
                continue
            moved = [w.copy() for w in widths]
            moved[t1][c1] -= 1
            moved[t2][c2] += 1
            assert distortion(lams, moved) >= best - 1e-12


def test_widths_follow_the_variances_and_one_level_spans_tensors():
    widths = water_fill([np.array([16.0, 4.0, 1.0]), np.array([64.0, 0.25])], 9)
    # each factor 4 of variance is worth one bit; the level (1) is shared by both tensors, and the
    # tie at the level goes to the first tensor
    assert widths[0].tolist() == [3, 2, 1] and widths[1].tolist() == [3, 0]


def test_zero_variance_channels_get_no_bits_even_with_budget_left():
    widths = water_fill([np.array([1.0, 0.0, 2.0, 0.0])], 100)
    assert widths[0].tolist() == [8, 0, 8, 0]  # 16 bits spent: nothing left to code
    assert water_fill([np.zeros(5)], 10)[0].tolist() == [0] * 5


def test_rejects_bad_arguments():
    with pytest.raises(KVConfigError, match="budget_bits"):
        water_fill([np.ones(3)], -1)
    with pytest.raises(KVConfigError, match="max_bits"):
        water_fill([np.ones(3)], 3, max_bits=9)
    with pytest.raises(KVConfigError, match="palu_bits"):
        WaterFillingPolicy(0)
    with pytest.raises(KVConfigError, match="palu_bits"):
        KVCacheConfig(palu_bits=9)


def test_policy_segments_spend_bits_times_channels():
    sv = np.sqrt(np.stack([0.6 ** np.arange(32), 0.5 ** np.arange(32)]))  # two head groups
    segments = WaterFillingPolicy(1.5).allocate(sv)
    assert segments[0].start == 0 and segments[-1].stop == 32
    assert sum(s.width * s.bits for s in segments) == 48
    assert [s.bits for s in segments] == sorted((s.bits for s in segments), reverse=True)
    assert segments[-1] == Segment(segments[-1].start, 32, 0)  # the tail is dropped


def test_cache_at_palu_bits_drops_channels_and_keeps_the_low_rank_signal():
    x = planted_lowrank((1, 4, 64, 32), rank=4, seed=5)
    v = planted_lowrank((1, 4, 64, 32), rank=6, seed=6)
    cache = PaluKVCache(KVCacheConfig(head_dim=32, palu_bits=0.75, palu_n_head_groups=1, palu_group_size=64))
    keys, values = cache.update_and_fetch(x, v)
    assert cache.fitted and cache.key_rank <= 6 and cache.value_rank <= 8
    # one level over the layer's keys and values: 0.75 bits x (32 + 32) channels, codes only
    spent = sum(s.width * s.bits for c in (cache._key_coder, cache._value_coder) for s in c.segments)
    assert spent == 48
    assert set(cache.state) >= {"key.steps", "key.codes", "value.steps", "value.codes"}
    # fixed quantizers: no scale or bias arrays (the per-token scale sits in each row's codes)
    assert not any("scales" in name for name in cache.state)
    assert rel_err(keys, x) < 0.2 and rel_err(values, v) < 0.2
    restored = PaluKVCache.from_state(cache.state, cache.meta_state)
    k2, _ = restored.update_and_fetch(x[:, :, :1], v[:, :, :1])
    k1, _ = cache.update_and_fetch(x[:, :, :1], v[:, :, :1])  # (a token leaves the exact window)
    assert mx.array_equal(k2, k1).item()


def test_an_explicit_policy_means_the_mixed_bit_coder_with_it():
    from palu_mlx import FixedQuantCoder, MixedBitCoder

    x = mx.random.normal((1, 2, 40, 16), key=mx.random.key(2))
    by_config = PaluKVCache(KVCacheConfig(palu_bits=2.0))
    by_policy = PaluKVCache(KVCacheConfig(palu_bits=2.0), allocation_policy=WaterFillingPolicy(2.0))
    for cache in (by_config, by_policy):
        cache.update_and_fetch(x, x)
    assert isinstance(by_config._key_coder, FixedQuantCoder)  # the config's coder: fixed quantizers
    assert isinstance(by_policy._key_coder, MixedBitCoder)  # the policy's segments, per-group scales
    assert any(name.endswith(".scales") for name in by_policy.state)
