"""The fitted cache's default config (``KVCacheConfig(method="palu")``) is the tier
``palu-2.25bit-scaled+rel``: relative-error weighing, chosen automatically where nothing else weighs
the keys against the values, while every named tier, saved
state, calibration and sensitivity profile keeps the weighing it was measured or saved with."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import pytest
from kvspec import KVConfigError
from palu_helpers import gaussian
from palu_mlx import KVCacheBuilder, KVCacheConfig, PaluKVCache
from palu_mlx.budgets import SensitivityProfile
from palu_mlx.coders import DEFAULT_PALU_BITS, HiLoSplit, WaterFilling
from palu_mlx.tiers import CALIBRATED_TIERS, SENSITIVITY_TIERS, TIERS, fixed_tier, tier

#: every tier's config and resolved coder as they were measured, written before the weighing's
#: default became automatic (fields added since are not in it); the names that left the registry
#: for the study configurations are checked there (benchmarks/tests/test_palu_study_tiers.py)
AS_MEASURED = json.loads((Path(__file__).parent / "tiers_as_measured.json").read_text())
EVERY_TIER = {**TIERS, **CALIBRATED_TIERS, **SENSITIVITY_TIERS}


def _bits(cache: PaluKVCache) -> tuple[int, int]:
    return sum(cache._key_coder.widths), sum(cache._value_coder.widths)


# ---------------------------------------------------------------------- the default
def test_the_default_config_is_the_tier_palu_2_25bit_scaled_rel():
    default, named = KVCacheConfig(method="palu"), tier("palu-2.25bit-scaled+rel").config
    assert DEFAULT_PALU_BITS == 2.25
    assert default == named  # field for field: one projection per KV head, bits and weighing automatic
    assert dataclasses.asdict(default.coder_choice) == {
        "bits": 2.25,
        "token_scale": True,
        "key_weight": 1.0,
        "value_weight": 1.0,
        "relative": True,
    }
    assert default.relative_error


def test_the_default_codes_as_the_tier_s_choices_stated():
    keys, values = gaussian((1, 2, 80, 16), seed=1), gaussian((1, 2, 80, 16), seed=2) * 0.05
    step_k, step_v = gaussian((1, 2, 1, 16), seed=3), gaussian((1, 2, 1, 16), seed=4) * 0.05
    default = KVCacheConfig(method="palu")
    stated = KVCacheConfig(palu_bits=2.25, palu_relative_error=True)
    assert (stated.palu_relative_error, default.palu_relative_error) == (True, None)
    assert stated.coder_choice == default.coder_choice
    out = []
    for config in (default, stated):
        cache = PaluKVCache(config)
        cache.update_and_fetch(keys, values)
        k, v = cache.update_and_fetch(step_k, step_v)
        out.append((_bits(cache), cache.nbytes, k, v))
    assert out[0][:2] == out[1][:2]
    assert mx.array_equal(out[0][2], out[1][2]) and mx.array_equal(out[0][3], out[1][3])


# ---------------------------------------------------------------------- every tier as measured
def _as_run(config: KVCacheConfig) -> dict:
    """The config's fields with the bits and weighing it leaves automatic read as it codes them."""
    fields = json.loads(config.to_json())
    return {**fields, "palu_bits": config.coder_bits, "palu_relative_error": config.relative_error}


def test_every_tier_means_the_configuration_it_was_measured_as():
    # every budgeted palu tier the snapshot predates only by its fields is in it
    assert {
        "palu-2.25bit-scaled+rel",
        "palu-2bit-scaled+rel",
        "palu-2bit-scaled",
        "reference-default",
    } <= set(AS_MEASURED)
    for name in AS_MEASURED.keys() & EVERY_TIER.keys():
        was = AS_MEASURED[name]
        config = EVERY_TIER[name].config
        now = _as_run(config)
        # the snapshot holds the registry's one head group, which palu-mlx compare never ran: it
        # replaced it by one projection per KV head, now the registry's own
        assert was["config"]["palu_n_head_groups"] == 1 and now["palu_n_head_groups"] is None, name
        measured = {**was["config"], "palu_n_head_groups": None}
        for key in ("palu_bits", "palu_relative_error"):  # as the config codes them
            assert now[key] == measured.pop(key), name
        # the snapshot's keywords say nothing the config does not (a value the coder does not read,
        # such as the hi/lo split's token scale, changes nothing)
        assert config.replace(**measured) == config, name
        coder = dict(was["coder"])
        kind = coder.pop("class")
        assert type(config.coder_choice).__name__ == kind, name
        assert dataclasses.asdict(config.coder_choice) == coder, name
        assert config.relative_error is coder.get("relative", False), name
    # only the +rel tiers weigh by relative error, and every tier states its weighing (none is left
    # to KVCacheConfig's automatic choice, so a tier does not move when the default does)
    for name, entry in EVERY_TIER.items():
        assert entry.config.relative_error is ("+rel" in name), name
        if isinstance(entry.config.coder, WaterFilling):  # the only coder that weighs
            assert entry.config.palu_relative_error is ("+rel" in name), name


def test_the_registry_reads_back_the_coders_it_was_measured_with():
    # spot checks written out, so the snapshot above cannot drift unnoticed
    assert tier("palu-2bit-scaled").config.coder_choice == WaterFilling(2.0, True, relative=False)
    assert fixed_tier(2).config.coder_choice == WaterFilling(2.0, False, relative=False)
    assert tier("palu-2.25bit-scaled+rel").config.coder_choice == WaterFilling(2.25, True, relative=True)
    assert tier("reference-default").config.coder_choice == HiLoSplit(4, 2, 0.25)
    assert tier("palu-2bit-scaled+cal").config.coder_choice == WaterFilling(2.0, True, relative=False)


# ---------------------------------------------------------------------- the automatic rule
@pytest.mark.parametrize(
    ("fields", "relative"),
    [
        ({"method": "palu"}, True),
        ({}, False),  # the rotation code: nothing to weigh
        ({"palu_bits": 3.0}, True),
        ({"palu_bits": 1.5, "palu_token_scale": False}, True),
        ({"palu_quantize_values": False}, True),
        ({"palu_rank": 8}, False),  # the reference's hi/lo split
        ({"palu_hi_bit": 4}, False),
        ({"palu_calibration": "model.palu-calibration.safetensors"}, False),
        ({"palu_sensitivity": "model.palu-sensitivity.json"}, False),
        ({"palu_key_weight": 2.0}, False),
        ({"palu_value_weight": 0.5}, False),
        ({"palu_relative_error": False}, False),
        ({"palu_relative_error": True}, True),
        ({"palu_relative_error": True, "palu_key_weight": 2.0}, True),
    ],
)
def test_the_weighing_is_relative_error_only_where_nothing_else_chooses_it(fields, relative):
    config = KVCacheConfig(**fields)
    assert config.palu_relative_error == fields.get("palu_relative_error")
    assert config.relative_error is relative
    coder = config.coder_choice
    if isinstance(coder, WaterFilling):
        assert coder.relative is relative  # read back resolved, never None
    assert KVCacheConfig.from_json(config.to_json()) == config


def test_the_coder_object_takes_the_same_rule():
    assert WaterFilling(2.0).relative is None and WaterFilling(2.0).relative_error
    assert not WaterFilling(2.0, key_weight=2.0).relative_error
    assert WaterFilling(2.0, key_weight=2.0, relative=True).relative_error
    assert WaterFilling().bits == DEFAULT_PALU_BITS
    # equal when they code alike
    assert WaterFilling(2.0) == WaterFilling(2.0, relative=True)
    assert hash(WaterFilling(2.0)) == hash(WaterFilling(2.0, relative=True))
    assert WaterFilling(2.0) != WaterFilling(2.0, relative=False)
    assert WaterFilling(2.0, value_weight=3.0) == WaterFilling(2.0, value_weight=3.0, relative=False)
    # given as coder=, it makes the config its flat fields make, and reads back the same
    for coder, flat in [
        (WaterFilling(2.0), {"palu_bits": 2.0}),
        (WaterFilling(2.0, relative=False), {"palu_bits": 2.0, "palu_relative_error": False}),
        (WaterFilling(2.0, relative=True), {"palu_bits": 2.0, "palu_relative_error": True}),
        (WaterFilling(2.0, key_weight=3.0), {"palu_bits": 2.0, "palu_key_weight": 3.0}),
    ]:
        config = KVCacheConfig(coder=coder)
        assert config == KVCacheConfig(**flat)
        assert config.coder_choice == coder and config.relative_error is coder.relative_error
    with pytest.raises(KVConfigError, match="palu_relative_error=False both choose the coder"):
        KVCacheConfig(coder=WaterFilling(2.0), palu_relative_error=False)
    with pytest.raises(KVConfigError, match="palu_relative_error=1"):
        KVCacheConfig(palu_relative_error=1)
    with pytest.raises(KVConfigError, match=r"relative=0 must be None \(automatic\), True or False"):
        WaterFilling(2.0, relative=0)


def test_the_automatic_weighing_spends_bits_on_a_small_tensor():
    keys, values = gaussian((1, 2, 128, 16), seed=3), gaussian((1, 2, 128, 16), seed=4) * 0.01
    spent = {}
    for stated in (None, False):
        cache = PaluKVCache(KVCacheConfig(palu_bits=2.0, palu_relative_error=stated, palu_sink_tokens=0))
        cache.update_and_fetch(keys, values)
        spent[stated] = _bits(cache)
    assert spent[None] == (32, 32)  # alike tensors share alike, as with palu_relative_error=True
    assert spent[False][1] <= 2  # by squared error the small values are all but dropped


def test_a_sensitivity_profile_keeps_squared_error_on_every_layer(tiny_model, tmp_path):
    # a profile whose every weight comes out 1: the layers' configs must still weigh squared error
    n = len(tiny_model.layers)
    spectrum = tuple(float(2.0**-i) for i in range(32))
    profile = SensitivityProfile(
        model={"architecture": "qwen3", "n_layers": n, "n_kv_heads": 4, "head_dim": 32},
        bits=2.0,
        key_kl=(0.01,) * n,
        value_kl=(0.01,) * n,
        key_error=(1.0,) * n,
        value_error=(1.0,) * n,
        key_variances=(spectrum,) * n,
        value_variances=(spectrum,) * n,
    )
    path = tmp_path / "tiny.palu-sensitivity.json"
    profile.save(path)
    caches = KVCacheBuilder.for_model(tiny_model, KVCacheConfig(head_dim=32, palu_sensitivity=str(path)))
    assert len(caches) == n
    for cache in caches:
        assert (cache.config.palu_key_weight, cache.config.palu_value_weight) == (1.0, 1.0)
        assert cache.config.palu_relative_error is False and not cache.config.relative_error
    # stated True, it stays True on every layer
    stated = KVCacheConfig(head_dim=32, palu_sensitivity=str(path), palu_relative_error=True)
    assert all(c.config.relative_error for c in KVCacheBuilder.for_model(tiny_model, stated))


# ---------------------------------------------------------------------- saved states
@pytest.mark.parametrize("stated", [False, True])
def test_a_state_saved_with_the_weighing_stated_loads_and_codes_as_saved(stated):
    config = KVCacheConfig(
        head_dim=16,
        palu_n_head_groups=1,
        palu_bits=2.0,
        palu_relative_error=stated,
        palu_sink_tokens=0,
        palu_min_fit_tokens=16,
    )
    keys, values = gaussian((1, 2, 128, 16), seed=3), gaussian((1, 2, 128, 16), seed=4) * 0.01
    cache = PaluKVCache(config)
    cache.update_and_fetch(keys[:, :, :8], values[:, :, :8])  # held exactly: the fit is still to come
    assert json.loads(cache.meta_state[0])["palu_relative_error"] is stated  # as versions before wrote it
    restored = PaluKVCache.from_state(cache.state)
    assert restored.config == config and restored.config.relative_error is stated
    outs = [c.update_and_fetch(keys[:, :, 8:], values[:, :, 8:]) for c in (cache, restored)]
    assert _bits(restored) == _bits(cache)
    assert (_bits(cache)[1] == 32) is stated  # relative error keeps the small values' bits
    assert all(mx.array_equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))
