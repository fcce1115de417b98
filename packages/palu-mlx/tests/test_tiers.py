"""The tier registry: at most eight tiers, one definition each, read by the conformance adapter."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import palu_mlx.kvspec_adapter as adapter_module
import pytest
from kvspec import KVConfigError, KVSpecError
from palu_helpers import planted_lowrank, rel_err
from palu_mlx import CALIBRATED_TIERS, TIERS, KVCacheConfig, PaluKVCache, Tier, tier
from palu_mlx.compare import tier_config
from palu_mlx.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS, REFERENCE_SPLIT
from palu_mlx.kvspec_adapter import PaluAdapter
from palu_mlx.tiers import (
    DEFAULT_TIER,
    MAX_TIERS,
    SENSITIVITY_TIERS,
    UNQUANTIZED,
    fixed_tier,
    palu_config,
    relative_tier,
)


def test_registry_is_keyed_by_tier_name_in_display_order():
    assert list(TIERS) == [
        "rotation-4bit",
        "rotation-3.5bit",
        "rotation-3bit",
        "palu-2.25bit-scaled+rel",
        "palu-2bit-scaled+rel",
        "palu-2bit-scaled",
        "palu-1.75bit-compact",
        "reference-default",
    ]
    for name, entry in TIERS.items():
        assert isinstance(entry, Tier) and entry.name == name and tier(name) is entry
        assert entry.description.strip() and "\n" not in entry.description
        assert entry.config.method in ("palu", "rotation") and entry.config.head_dim is None


def test_every_registry_holds_at_most_eight_tiers():
    assert MAX_TIERS == 8
    for registry in (TIERS, CALIBRATED_TIERS, SENSITIVITY_TIERS):
        assert 1 <= len(registry) <= MAX_TIERS


def test_the_default_tier_is_a_registered_rotation_tier():
    assert DEFAULT_TIER == "rotation-3.5bit"
    assert tier(DEFAULT_TIER).config.method == "rotation" and tier(DEFAULT_TIER).calibration is None


def test_the_2_25bit_relative_tier_spells_out_its_fields():
    # no field left to KVCacheConfig's automatic choices: the tier means this whatever the default is
    config = tier("palu-2.25bit-scaled+rel").config
    assert relative_tier(2.25) == tier("palu-2.25bit-scaled+rel")
    assert (config.method, config.palu_bits, config.palu_relative_error) == ("palu", 2.25, True)
    assert config.palu_token_scale and (config.palu_sink_tokens, config.palu_recent_tokens) == (
        DEFAULT_SINK_TOKENS,
        DEFAULT_RECENT_TOKENS,
    ) == (4, 32)
    assert config.relative_error and config.coder_bits == 2.25


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


@pytest.mark.parametrize("bits", [3, 2, 1.5, 1.25, 1])
def test_fixed_quantizer_tiers_spend_their_bits(bits):
    # the builder the study configurations palu-<bits>bit are made with
    config = fixed_tier(bits).config
    cache = PaluKVCache(config)
    x = planted_lowrank((1, 4, 128, 64), rank=8, seed=1)
    cache.update_and_fetch(x, x)
    spent = sum(s.width * s.bits for c in (cache._key_coder, cache._value_coder) for s in c.segments)
    assert spent == round(config.palu_bits * 128)
    assert not any("scales" in n for n in cache.state)


def test_unknown_tier_names_the_value_and_the_allowed_names():
    with pytest.raises(
        KVConfigError, match=r"tier='default'.*allowed: rotation-4bit, rotation-3.5bit"
    ) as info:
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
        tier("reference-default").name = "other"


def test_conformance_cases_are_the_tiers():
    cases = PaluAdapter().configs()
    assert [c.name for c in cases] == list(TIERS)
    assert all(c.config is TIERS[c.name].config for c in cases)
    assert "TIERS" not in adapter_module.__all__


def test_every_tier_caches_and_errors_grow_down_the_list():
    x = planted_lowrank((1, 4, 80, 64), 12, seed=3, noise=0.05, dtype=mx.float16)

    def error(config: KVCacheConfig) -> float:
        cache = PaluAdapter().make(config)
        keys, values = cache.update_and_fetch(x, x)
        assert cache.fitted and keys.shape == values.shape == x.shape and keys.dtype == mx.float16
        return rel_err(keys, x)

    errors = {name: error(entry.config) for name, entry in TIERS.items()}
    assert [errors[n] for n in ("rotation-4bit", "rotation-3.5bit", "rotation-3bit")] == sorted(
        errors[n] for n in ("rotation-4bit", "rotation-3.5bit", "rotation-3bit")
    )
    # the builders' families, each from easiest to hardest: the change of basis alone, low rank,
    # the reference's split, rank 8 in 4 bits; fixed quantizers from 3 bits down to 1
    ranks = [
        palu_config(palu_rank=64, **UNQUANTIZED),
        palu_config(palu_rank=16, **UNQUANTIZED),
        tier("reference-default").config,
        palu_config(palu_rank=8, palu_hi_bit=4, palu_lo_bit=4),
    ]
    for family in (ranks, [fixed_tier(bits).config for bits in (3, 2, 1.5, 1.25, 1)]):
        measured = [error(config) for config in family]
        assert measured == sorted(measured)
    assert error(ranks[0]) < 1e-2


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
    assert "palu-2bit-scaled+cal" in CALIBRATED_TIERS  # results files and docs read this name
    for name, twin in CALIBRATED_TIERS.items():
        base = TIERS[name.removesuffix("+cal")]
        assert tier(name) is twin and twin.calibration == "model" and name not in TIERS
        assert twin.config == base.config and twin.config.palu_calibration is None
        assert twin.description.startswith(base.description)


def test_with_calibration_binds_a_file_the_way_compare_always_named_it():
    twin = tier("palu-2bit-scaled+cal")
    bound = twin.with_calibration("/models/m.palu-calibration.safetensors")
    base = tier("palu-2bit-scaled")
    assert bound.name == "palu-2bit-scaled+cal" and bound.calibration == "model"
    assert bound.description == (
        f"{base.description}; calibrated (m.palu-calibration.safetensors): fixed projections and quantizers"
    )
    assert bound.config == dataclasses.replace(
        base.config, palu_calibration="/models/m.palu-calibration.safetensors"
    )
    assert twin.config.palu_calibration is None  # the registry's entry is unchanged
    # sized for a model: the uncalibrated tier's config plus the file
    sized = tier_config("palu-2bit-scaled+cal", 64, 4, "f.safetensors")
    assert sized == dataclasses.replace(
        tier_config("palu-2bit-scaled", 64, 4), palu_calibration="f.safetensors"
    )


def test_calibration_goes_only_where_a_tier_needs_one():
    with pytest.raises(KVConfigError, match="'reference-default' needs no calibration"):
        tier("reference-default").with_calibration("f.safetensors")
    with pytest.raises(KVConfigError, match="path=''"):
        tier("palu-2bit-scaled+cal").with_calibration("")
    with pytest.raises(KVConfigError, match=r"'palu-2bit-scaled\+cal' needs calibration="):
        tier_config("palu-2bit-scaled+cal", 64, 4)
    with pytest.raises(KVConfigError, match="'palu-2bit-scaled' takes no calibration"):
        tier_config("palu-2bit-scaled", 64, 4, "f.safetensors")
