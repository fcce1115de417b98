"""The tier registry: one definition per tier, read by the conformance adapter."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import palu_mlx.kvspec_adapter as adapter_module
import pytest
from kvspec import KVConfigError, KVSpecError
from palu_helpers import planted_lowrank, rel_err
from palu_mlx import CALIBRATED_TIERS, TIERS, KVCacheConfig, PaluKVCache, Tier, tier
from palu_mlx.compare import tier_config
from palu_mlx.config import REFERENCE_SPLIT
from palu_mlx.kvspec_adapter import PaluAdapter


def test_registry_is_keyed_by_tier_name_in_display_order():
    assert list(TIERS) == [
        "full-rank-fp16",
        "r16-fp16",
        "reference-default",
        "r8-4bit",
        "rotation-4bit",
        "rotation-3.5bit",
        "rotation-3bit",
        "palu-3bit-scaled",
        "palu-2.5bit-scaled",
        "palu-2bit-scaled",
        "palu-1.75bit-compact",
        "palu-1.7bit-compact-fill",
        "palu-3.25bit-scaled+rel",
        "palu-3bit-scaled+rel",
        "palu-2.5bit-scaled+rel",
        "palu-2.25bit-scaled+rel",
        "palu-2bit-scaled+rel",
        "palu-3bit",
        "palu-2bit",
        "palu-1.5bit",
        "palu-1.25bit",
        "palu-1bit",
    ]
    for name, entry in TIERS.items():
        assert isinstance(entry, Tier) and entry.name == name and tier(name) is entry
        assert entry.description.strip() and "\n" not in entry.description
        assert entry.config.method in ("palu", "rotation") and entry.config.head_dim is None


def test_reference_default_is_the_config_defaults_after_rope():
    # the reference cached post-RoPE keys: its tier keeps doing so, so the change shows in results
    # (and without the per-token scale, exact first tokens and automatic weighing, which came later);
    # one projection per KV head, as palu-mlx compare measured it
    assert tier("reference-default").config == KVCacheConfig(
        method="palu",
        palu_pre_rope=False,
        palu_token_scale=False,
        palu_sink_tokens=0,
        palu_recent_tokens=0,
        palu_relative_error=False,
        **REFERENCE_SPLIT,
    )


@pytest.mark.parametrize("name", ["palu-3bit", "palu-2bit", "palu-1.5bit", "palu-1.25bit", "palu-1bit"])
def test_water_filling_tiers_spend_their_bits_with_fixed_quantizers(name):
    config = tier(name).config
    cache = PaluKVCache(config)
    x = planted_lowrank((1, 4, 128, 64), rank=8, seed=1)
    cache.update_and_fetch(x, x)
    spent = sum(s.width * s.bits for c in (cache._key_coder, cache._value_coder) for s in c.segments)
    assert spent == round(config.palu_bits * 128)
    assert not any("scales" in n for n in cache.state)


def test_unknown_tier_names_the_value_and_the_allowed_names():
    with pytest.raises(KVConfigError, match=r"tier='default'.*allowed: full-rank-fp16, r16-fp16") as info:
        tier("default")
    assert isinstance(info.value, ValueError) and isinstance(info.value, KVSpecError)
    with pytest.raises(KVConfigError, match="tier=None"):
        tier(None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", ""),
        ("description", "two\nlines"),
        ("config", KVCacheConfig(method="naive")),
        ("calibration", "some-file.safetensors"),
    ],
)
def test_tier_rejects_bad_fields(field, value):
    good = dict(name="x", description="one line", config=KVCacheConfig())
    with pytest.raises(KVConfigError, match=field):
        Tier(**{**good, field: value})


def test_tier_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        tier("r8-4bit").name = "other"


def test_conformance_cases_are_the_tiers():
    cases = PaluAdapter().configs()
    assert [c.name for c in cases] == list(TIERS)
    assert all(c.config is TIERS[c.name].config for c in cases)
    assert "TIERS" not in adapter_module.__all__


def test_every_tier_caches_and_errors_grow_down_the_list():
    x = planted_lowrank((1, 4, 80, 64), 12, seed=3, noise=0.05, dtype=mx.float16)
    errors = {}
    for name, entry in TIERS.items():
        cache = PaluAdapter().make(entry.config)
        keys, values = cache.update_and_fetch(x, x)
        assert cache.fitted and keys.shape == values.shape == x.shape and keys.dtype == mx.float16
        errors[name] = rel_err(keys, x)
    # two families, each from easiest to hardest
    for family in (
        ["full-rank-fp16", "r16-fp16", "reference-default", "r8-4bit"],
        ["palu-3bit", "palu-2bit", "palu-1.5bit", "palu-1.25bit", "palu-1bit"],
        ["rotation-4bit", "rotation-3bit"],
    ):
        assert [errors[n] for n in family] == sorted(errors[n] for n in family)
    assert errors["full-rank-fp16"] < 1e-2


def test_calibrated_tiers_are_the_bit_budget_tiers_twins_in_their_order():
    budget = [
        name
        for name, t in TIERS.items()
        if t.config.method == "palu"
        and t.config.palu_bits is not None
        and not t.config.palu_relative_error
        and (t.config.palu_basis_bits, t.config.palu_scale_bits)
        == (16, 16)  # a calibration's are the model's
    ]
    assert list(CALIBRATED_TIERS) == [f"{name}+cal" for name in budget]
    assert "palu-1.75bit-compact+cal" not in CALIBRATED_TIERS
    assert "palu-2.5bit-scaled+cal" in CALIBRATED_TIERS  # results files and docs read this name
    for name, twin in CALIBRATED_TIERS.items():
        base = TIERS[name.removesuffix("+cal")]
        assert tier(name) is twin and twin.calibration == "model" and name not in TIERS
        assert twin.config == base.config and twin.config.palu_calibration is None
        assert twin.description.startswith(base.description)


def test_with_calibration_binds_a_file_the_way_compare_always_named_it():
    twin = tier("palu-2.5bit-scaled+cal")
    bound = twin.with_calibration("/models/m.palu-calibration.safetensors")
    base = tier("palu-2.5bit-scaled")
    assert bound.name == "palu-2.5bit-scaled+cal" and bound.calibration == "model"
    assert bound.description == (
        f"{base.description}; calibrated (m.palu-calibration.safetensors): fixed projections and quantizers"
    )
    assert bound.config == dataclasses.replace(
        base.config, palu_calibration="/models/m.palu-calibration.safetensors"
    )
    assert twin.config.palu_calibration is None  # the registry's entry is unchanged
    # sized for a model: the uncalibrated tier's config plus the file
    sized = tier_config("palu-2.5bit-scaled+cal", 64, 4, "f.safetensors")
    assert sized == dataclasses.replace(
        tier_config("palu-2.5bit-scaled", 64, 4), palu_calibration="f.safetensors"
    )


def test_calibration_goes_only_where_a_tier_needs_one():
    with pytest.raises(KVConfigError, match="'r8-4bit' needs no calibration"):
        tier("r8-4bit").with_calibration("f.safetensors")
    with pytest.raises(KVConfigError, match="path=''"):
        tier("palu-2bit+cal").with_calibration("")
    with pytest.raises(KVConfigError, match=r"'palu-2bit\+cal' needs calibration="):
        tier_config("palu-2bit+cal", 64, 4)
    with pytest.raises(KVConfigError, match="'palu-2bit' takes no calibration"):
        tier_config("palu-2bit", 64, 4, "f.safetensors")
