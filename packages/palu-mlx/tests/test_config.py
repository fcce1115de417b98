"""KVCacheConfig validation: every bad field raises KVConfigError naming it."""

from __future__ import annotations

import pytest
from kvspec import KVConfigError
from palu_mlx import KVCacheConfig
from palu_mlx.config import DEFAULT_PALU_BITS


def test_defaults():
    cfg = KVCacheConfig(method="palu", head_dim=128)
    assert (cfg.palu_rank, cfg.palu_energy_threshold, cfg.palu_n_head_groups) == (None, None, None)
    assert (cfg.palu_hi_bit, cfg.palu_lo_bit, cfg.palu_hi_fraction, cfg.palu_bits) == (None, None, None, None)
    # nothing asked: water-filling at the default budget
    assert not cfg.uses_split and cfg.coder_bits == DEFAULT_PALU_BITS
    # any split field asks for the reference's split, the rest from REFERENCE_SPLIT
    split = KVCacheConfig(head_dim=128, palu_hi_bit=8)
    assert split.uses_split and split.coder_bits is None
    assert (split.hi_bit, split.lo_bit, split.hi_fraction, split.energy_threshold) == (8, 2, 0.25, 0.90)
    assert KVCacheConfig(head_dim=128, palu_rank=8).uses_split
    # palu_bits wins over the split fields (as saved configs of older versions carry them)
    assert KVCacheConfig(head_dim=128, palu_bits=1.5, palu_hi_bit=4).coder_bits == 1.5
    assert (cfg.palu_group_size, cfg.palu_quantize_values) == (32, True)
    assert cfg.min_fit_tokens(128) == 128  # default minimum before fitting = head_dim


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("method", "svdq"),
        ("head_dim", 8.0),
        ("head_dim", 0),
        ("palu_rank", 0),
        ("palu_rank", 65),
        ("palu_rank", 8.0),
        ("palu_energy_threshold", 0.0),
        ("palu_energy_threshold", 1.5),
        ("palu_energy_threshold", float("nan")),
        ("palu_n_head_groups", 0),
        ("palu_hi_bit", 7),
        ("palu_lo_bit", 0),
        ("palu_lo_bit", 32),
        ("palu_hi_bit", True),
        ("palu_hi_fraction", -0.1),
        ("palu_hi_fraction", 1.01),
        ("palu_group_size", 0),
        ("palu_group_size", 2.5),
        ("palu_quantize_values", "yes"),
        ("palu_min_fit_tokens", 0),
        ("naive_bits", 16),
        ("naive_group_size", 16),
    ],
)
def test_bad_values_raise_config_error_naming_the_field(field, value):
    kwargs = {"method": "palu", "head_dim": 64, field: value}
    with pytest.raises(KVConfigError, match=field):
        KVCacheConfig(**kwargs)
    assert issubclass(KVConfigError, ValueError)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_fraction_bounds_are_inclusive(fraction):
    assert KVCacheConfig(head_dim=64, palu_hi_fraction=fraction).palu_hi_fraction == fraction


def test_json_round_trip():
    cfg = KVCacheConfig(head_dim=64, palu_rank=16, palu_quantize_values=False, palu_min_fit_tokens=8)
    assert KVCacheConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(KVConfigError, match="unknown"):
        KVCacheConfig.from_json('{"head_dim": 64, "palu_bogus": 1}')
