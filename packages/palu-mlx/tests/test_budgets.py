"""Sensitivity budgets: weighted water-filling, the profile, its allocation, the builder and tiers."""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest
from kvspec import KVConfigError, KVDataError
from palu_helpers import gaussian, planted_lowrank
from palu_mlx import KVCacheBuilder, KVCacheConfig, PaluKVCache
from palu_mlx.budgets import (
    PROFILE_FORMAT,
    SensitivityProfile,
    code_tensor,
    measure_sensitivity,
    profile_path,
)
from palu_mlx.coders import WaterFilling
from palu_mlx.compare import tier_config
from palu_mlx.tiers import SENSITIVITY_SUFFIX, SENSITIVITY_TIERS, TIERS, tier


def _bits(cache: PaluKVCache) -> tuple[int, int]:
    return sum(cache._key_coder.widths), sum(cache._value_coder.widths)


def _profile(n=4, dim=8, key_kl=None, value_kl=None, **model) -> SensitivityProfile:
    spectrum = tuple(float(2.0**-i) for i in range(dim))
    return SensitivityProfile(
        model={"architecture": "qwen3", "n_layers": n, "n_kv_heads": 4, "head_dim": dim, **model},
        bits=2.0,
        key_kl=key_kl or (0.01,) * n,
        value_kl=value_kl or (0.01,) * n,
        key_error=(1.0,) * n,
        value_error=(1.0,) * n,
        key_variances=(spectrum,) * n,
        value_variances=(spectrum,) * n,
    )


# ---------------------------------------------------------------------- weighted water-filling
@pytest.mark.parametrize("field", ["key_weight", "value_weight"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), True, "2"])
def test_water_filling_weights_must_be_positive_numbers(field, value):
    with pytest.raises(KVConfigError, match=field):
        WaterFilling(2.0, True, **{field: value})


def test_a_heavier_key_weight_moves_the_layers_bits_to_the_keys_and_keeps_the_total():
    x = gaussian((1, 2, 128, 16), seed=3)
    v = gaussian((1, 2, 128, 16), seed=4)
    spent = {}
    for kw in (1.0, 64.0, 1 / 64):
        cache = PaluKVCache(KVCacheConfig(palu_bits=2.0, palu_key_weight=kw, palu_sink_tokens=0))
        cache.update_and_fetch(x, v)
        spent[kw] = _bits(cache)
    assert {sum(b) for b in spent.values()} == {64}  # round(2 bits * 32 channels)
    assert spent[64.0][0] > spent[1.0][0] > spent[1 / 64][0]


def test_unit_weights_code_as_before():
    x = planted_lowrank((1, 4, 96, 32), rank=6, seed=2, noise=0.05)
    a, b = (
        PaluKVCache(KVCacheConfig(palu_bits=2.5)),
        PaluKVCache(KVCacheConfig(palu_bits=2.5, palu_key_weight=1.0)),
    )
    ka, _ = a.update_and_fetch(x, x)
    kb, _ = b.update_and_fetch(x, x)
    assert mx.array_equal(ka, kb)


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"palu_key_weight": 0.0}, "palu_key_weight=0.0"),
        ({"palu_value_weight": float("nan")}, "palu_value_weight=nan"),
        ({"palu_sensitivity": ""}, "palu_sensitivity=''"),
        ({"palu_sensitivity": 3}, "palu_sensitivity=3"),
        ({"palu_rank": 8, "palu_key_weight": 2.0}, "water-filling coder"),
        ({"palu_hi_bit": 4, "palu_sensitivity": "p.json"}, "water-filling coder"),
        ({"palu_sensitivity": "p.json", "palu_calibration": "c.safetensors"}, "allowed: one of them"),
        (
            {"palu_key_weight": 2.0, "coder": WaterFilling(2.0, True, 3.0)},
            "palu_key_weight=2.0 both choose the coder",
        ),
    ],
)
def test_config_refuses_bad_weights_and_profiles(fields, match):
    with pytest.raises(KVConfigError, match=match):
        KVCacheConfig(**fields)


def test_config_weights_round_trip_and_reach_the_coder():
    config = KVCacheConfig(
        palu_bits=2.0, palu_key_weight=3.5, palu_value_weight=0.25, palu_sensitivity="p.json"
    )
    assert KVCacheConfig.from_json(config.to_json()) == config
    assert config.coder_choice == WaterFilling(2.0, True, 3.5, 0.25)
    assert KVCacheConfig(coder=WaterFilling(2.0, True, 3.0, 0.5)).palu_key_weight == 3.0


# ---------------------------------------------------------------------- the profile
def test_allocate_spends_the_average_and_favours_the_sensitive_layer():
    profile = _profile(key_kl=(0.001, 0.001, 0.1, 0.001), value_kl=(0.001,) * 4)
    coders = profile.allocate(2.0)
    spent = [round(c.bits * 16) for c in coders]
    assert sum(spent) == round(2.0 * 16 * 4)
    assert spent[2] == max(spent) and spent[2] > spent[0]
    assert coders[2].key_weight > coders[2].value_weight
    # alike layers: alike budgets, at the average
    assert {round(c.bits * 16) for c in _profile().allocate(2.5)} == {40}


def test_weights_are_floored_and_scaled_to_the_median():
    profile = _profile(key_kl=(0.0, 0.01, 0.01, 0.01), value_kl=(0.01,) * 4)
    wk, wv = profile.weights()
    assert np.median(np.concatenate([wk, wv])) == pytest.approx(1.0)
    assert wk[0] == pytest.approx(0.01)  # WEIGHT_FLOOR of the median, not 0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"key_kl": (0.1,) * 3}, "key_kl must be 4 numbers"),
        ({"value_kl": (-0.1,) * 4}, "value_kl must hold finite numbers >= 0"),
        ({"key_error": (0.0,) * 4}, "key_error must hold finite numbers > 0"),
        ({"bits": 9}, "bits=9"),
        ({"model": {"n_layers": "4"}}, "n_layers"),
        ({"value_variances": ((1.0,),) * 3}, "value_variances must be 4 lists"),
    ],
)
def test_profile_refuses_bad_fields(change, match):
    good = _profile()
    with pytest.raises(KVConfigError, match=match):
        dataclasses.replace(good, **change)


@pytest.mark.parametrize("bits", [0, 8.5, float("nan"), True, "2"])
def test_allocate_refuses_bad_bits(bits):
    with pytest.raises(KVConfigError, match="bits="):
        _profile().allocate(bits)


def test_profile_files_round_trip_and_bad_files_name_the_file(tmp_path):
    profile = _profile(key_kl=(0.001, 0.002, 0.1, 0.003))
    path = tmp_path / "m.palu-sensitivity.json"
    profile.save(path)
    assert SensitivityProfile.load(path) == profile
    assert profile_path(tmp_path / "m") == path
    data = json.loads(path.read_text())
    bad = {
        "not json": "{",
        "format": json.dumps({**data, "format": "other"}),
        "fields": json.dumps({k: v for k, v in data.items() if k != "key_kl"}),
        "values": json.dumps({**data, "key_error": [0.0] * 4}),
    }
    for case, text in bad.items():
        broken = tmp_path / f"{case}.json"
        broken.write_text(text)
        with pytest.raises(KVDataError, match=str(broken.name)):
            SensitivityProfile.load(broken)
    assert data["format"] == PROFILE_FORMAT


# ---------------------------------------------------------------------- measuring
def test_code_tensor_keeps_the_first_tokens_and_errs_less_with_more_bits():
    x = planted_lowrank((1, 2, 64, 16), rank=5, seed=5, noise=0.1).astype(mx.bfloat16)
    errors = []
    for bits in (1.0, 2.0, 4.0):
        rec, err, var = code_tensor(x, bits, sink_tokens=4)
        assert rec.shape == x.shape and rec.dtype == x.dtype
        assert mx.array_equal(rec[..., :4, :], x[..., :4, :])
        assert var.shape == (16,) and np.all(np.diff(var) <= 0)
        errors.append(err)
    assert errors[0] > errors[1] > errors[2] > 0
    with pytest.raises(KVConfigError, match="bits=0"):
        code_tensor(x, 0)


def test_measure_sensitivity_on_the_tiny_model_builds_per_layer_caches(tiny_model, tmp_path):
    windows = [list(range(3, 99)), list(range(40, 136))]
    profile = measure_sensitivity(tiny_model, windows, scored=8, bits=1.5)
    n = len(tiny_model.layers)
    assert profile.n_layers == n and profile.model["head_dim"] == 32
    assert all(k > 0 for k in profile.key_kl + profile.value_kl)
    path = tmp_path / "tiny.palu-sensitivity.json"
    profile.save(path)
    config = dataclasses.replace(
        tier_config("palu-2bit-scaled" + SENSITIVITY_SUFFIX, 32, 4, str(path)), palu_min_fit_tokens=16
    )
    caches = KVCacheBuilder.for_model(tiny_model, config)
    layer_bits = [round(c.config.palu_bits * 64) for c in caches]
    assert sum(layer_bits) == round(2.0 * 64 * n)
    assert all(c.config.palu_sensitivity is None for c in caches)
    logits = tiny_model(mx.array(windows[0])[None], cache=caches)
    assert bool(mx.all(mx.isfinite(logits)).item())
    assert [sum(_bits(c)) for c in caches] == layer_bits
    # a profile of a model of another shape is refused by name
    other = dataclasses.replace(
        profile,
        model={**profile.model, "n_layers": n + 1},
        key_kl=(0.1,) * (n + 1),
        value_kl=(0.1,) * (n + 1),
        key_error=(1.0,) * (n + 1),
        value_error=(1.0,) * (n + 1),
        key_variances=profile.key_variances + profile.key_variances[:1],
        value_variances=profile.value_variances + profile.value_variances[:1],
    )
    other.save(tmp_path / "other.json")
    with pytest.raises(KVConfigError, match="n_layers"):
        KVCacheBuilder.for_model(
            tiny_model, dataclasses.replace(config, palu_sensitivity=str(tmp_path / "other.json"))
        )
    with pytest.raises(KVConfigError, match="cannot be read"):
        KVCacheBuilder.for_model(
            tiny_model, dataclasses.replace(config, palu_sensitivity=str(tmp_path / "none.json"))
        )


def test_measure_sensitivity_refuses_windows_too_short(tiny_model):
    with pytest.raises(KVConfigError, match="longer than scored"):
        measure_sensitivity(tiny_model, [list(range(8))], scored=8)


# ---------------------------------------------------------------------- tiers
def test_sensitivity_tiers_are_twins_of_the_scaled_bit_budget_tiers():
    assert list(SENSITIVITY_TIERS) == [
        n + SENSITIVITY_SUFFIX
        for n, t in TIERS.items()
        # the rotation code fits nothing a profile could spread bits over
        if t.config.method == "palu"
        and t.config.palu_bits
        and t.config.palu_token_scale
        and not t.config.relative_error
    ]
    # results files and docs read these names
    assert list(SENSITIVITY_TIERS) == ["palu-2bit-scaled+sens", "palu-1.75bit-compact+sens"]
    name = "palu-2bit-scaled" + SENSITIVITY_SUFFIX
    entry = tier(name)
    assert entry.calibration == "sensitivity" and entry.config.palu_sensitivity is None
    bound = entry.with_calibration("/x/m.palu-sensitivity.json")
    assert bound.config.palu_sensitivity == "/x/m.palu-sensitivity.json"
    assert bound.config.palu_calibration is None and "m.palu-sensitivity.json" in bound.description
    with pytest.raises(KVConfigError, match="sensitivity profile"):
        entry.with_calibration("")
    with pytest.raises(KVConfigError, match="needs calibration"):
        tier_config(name, 64, 3)


# ---------------------------------------------------------------------- relative error at the prefill
def test_relative_error_keeps_bits_on_a_small_tensor():
    x = gaussian((1, 2, 128, 16), seed=3)
    v = gaussian((1, 2, 128, 16), seed=4) * 0.01  # alike in shape, 100x smaller
    spent = {}
    for relative in (False, True):
        cache = PaluKVCache(KVCacheConfig(palu_bits=2.0, palu_relative_error=relative, palu_sink_tokens=0))
        cache.update_and_fetch(x, v)
        spent[relative] = _bits(cache)
    assert spent[False][1] <= 2  # by squared error the small values are all but dropped
    assert spent[True] == (32, 32)  # by relative error alike tensors share alike
    assert KVCacheConfig(palu_relative_error=True).coder_choice.relative


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"palu_relative_error": 1}, "palu_relative_error=1"),
        ({"palu_relative_error": True, "palu_hi_bit": 4}, "water-filling coder"),
        ({"palu_relative_error": True, "coder": WaterFilling(2.0)}, "both choose the coder"),
    ],
)
def test_relative_error_refuses_bad_values(fields, match):
    with pytest.raises(KVConfigError, match=match):
        KVCacheConfig(**fields)
    with pytest.raises(KVConfigError, match="relative"):
        WaterFilling(2.0, relative="yes")
