"""KVCacheConfig validation: every bad field raises KVConfigError naming it."""

from __future__ import annotations

import pytest
from kvspec import KVConfigError
from palu_mlx import KVCacheConfig
from palu_mlx.coders import Rotation
from palu_mlx.config import DEFAULT_PALU_BITS


def test_defaults():
    # nothing asked: the rotation code at 3.5 bits (keys 4, values 3), the newest tokens in int8
    default = KVCacheConfig()
    assert default.method == "rotation" and default.coder == Rotation(3.5) and default.palu_bits == 3.5
    assert (default.exact.sink, default.exact.recent, default.exact.recent_bits) == (4, 32, 8)
    assert KVCacheConfig(head_dim=64).method == "rotation"
    # a keyword only the fitted cache reads asks for it
    assert KVCacheConfig(palu_bits=2.0).method == KVCacheConfig(palu_rank=8).method == "palu"
    # ... given a value of its own: a keyword passed at its default asks for nothing
    assert KVCacheConfig(palu_bits=None, palu_calibration=None, palu_group_size=32).method == "rotation"
    cfg = KVCacheConfig(method="palu", head_dim=128)
    assert (cfg.palu_rank, cfg.palu_energy_threshold, cfg.palu_n_head_groups) == (None, None, None)
    assert (cfg.palu_hi_bit, cfg.palu_lo_bit, cfg.palu_hi_fraction) == (None, None, None)
    assert cfg.palu_bits == DEFAULT_PALU_BITS and cfg.exact.recent_bits == 16
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


# ----------------------------------------------------------------------------- the coder as an object
def test_the_palu_fields_choose_a_coder_object():
    from palu_mlx import HiLoSplit, WaterFilling

    assert KVCacheConfig(method="palu").coder_choice == WaterFilling(DEFAULT_PALU_BITS, token_scale=True)
    assert KVCacheConfig(palu_bits=1.5, palu_token_scale=False).coder_choice == WaterFilling(
        1.5, token_scale=False
    )
    assert KVCacheConfig(palu_rank=8).coder_choice == HiLoSplit(4, 2, 0.25)
    assert KVCacheConfig(palu_hi_bit=8, palu_hi_fraction=0.5).coder_choice == HiLoSplit(8, 2, 0.5)


def test_coder_writes_its_fields_and_reads_back_the_same():
    import dataclasses

    from palu_mlx import HiLoSplit, WaterFilling

    budget = KVCacheConfig(coder=WaterFilling(bits=2.0, token_scale=False))
    assert budget == KVCacheConfig(palu_bits=2.0, palu_token_scale=False)
    assert budget.coder_choice == WaterFilling(2.0, token_scale=False) and budget.coder_bits == 2.0
    split = KVCacheConfig(coder=HiLoSplit(hi_bit=8, lo_bit=4, hi_fraction=0.5), palu_rank=16)
    assert split == KVCacheConfig(palu_hi_bit=8, palu_lo_bit=4, palu_hi_fraction=0.5, palu_rank=16)
    assert split.uses_split and split.coder_choice == HiLoSplit(8, 4, 0.5)
    # the JSON form is the flat keywords, and reads back the same config
    assert "coder" not in split.to_json() and KVCacheConfig.from_json(split.to_json()) == split
    assert dataclasses.replace(split, head_dim=64).coder_choice == split.coder_choice
    # replace() changes keywords, a choosing one included: the old choice is not kept
    assert budget.replace(palu_bits=3.0).coder_choice == WaterFilling(3.0, token_scale=False)
    energy = KVCacheConfig(palu_energy_threshold=0.8)
    assert energy.replace(palu_hi_bit=8).coder_choice == HiLoSplit(8, 2, 0.25)
    # dataclasses.replace passes the coder back in: a choosing keyword beside it is refused, clearly
    with pytest.raises(KVConfigError, match=r"config.replace\(palu_bits=...\)"):
        dataclasses.replace(budget, palu_bits=3.0)
    assert budget == KVCacheConfig(palu_bits=2.0, palu_token_scale=False)  # unchanged
    # a field that agrees with the coder is no conflict
    assert KVCacheConfig(coder=WaterFilling(3.0), palu_bits=3.0).coder_bits == 3.0


@pytest.mark.parametrize(
    ("coder", "fields", "match"),
    [
        ("water", {"palu_hi_bit": 4}, "palu_hi_bit=4 both choose the coder"),
        ("water", {"palu_bits": 1.0}, "palu_bits=1.0 both choose the coder"),
        ("split", {"palu_bits": 2.0}, "palu_bits=2.0 both choose the coder"),
        ("split", {"palu_lo_bit": 1}, "palu_lo_bit=1 both choose the coder"),
        ("text", {}, "coder='water-filling' must be None or one of palu_mlx.coders.Rotation"),
    ],
)
def test_a_coder_and_fields_that_disagree_are_refused(coder, fields, match):
    from palu_mlx import HiLoSplit, WaterFilling

    given = {"water": WaterFilling(2.5), "split": HiLoSplit(), "text": "water-filling"}[coder]
    with pytest.raises(KVConfigError, match=match):
        KVCacheConfig(coder=given, **fields)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda c: c.WaterFilling(bits=0), r"WaterFilling bits=0 must be a number in \(0, 8\]"),
        (lambda c: c.WaterFilling(bits=9.0), "WaterFilling bits=9.0"),
        (lambda c: c.WaterFilling(token_scale=1), "WaterFilling token_scale=1 must be True or False"),
        (
            lambda c: c.HiLoSplit(hi_bit=7),
            "HiLoSplit hi_bit=7 cannot be packed; allowed: 1, 2, 3, 4, 5, 6, 8, 16",
        ),
        (lambda c: c.HiLoSplit(lo_bit=True), "HiLoSplit lo_bit=True"),
        (lambda c: c.HiLoSplit(hi_fraction=1.5), r"HiLoSplit hi_fraction=1.5 must be a number in \[0, 1\]"),
    ],
)
def test_coder_objects_check_their_fields(make, match):
    import palu_mlx.coders as coders

    with pytest.raises(KVConfigError, match=match):
        make(coders)


def test_a_cache_from_a_coder_object_is_the_cache_from_the_fields():
    import mlx.core as mx
    import numpy as np
    from palu_mlx import HiLoSplit, PaluKVCache, WaterFilling

    x = mx.random.normal((1, 2, 40, 16), key=mx.random.key(5))
    pairs = [
        (KVCacheConfig(coder=WaterFilling(2.0)), KVCacheConfig(palu_bits=2.0)),
        (
            KVCacheConfig(coder=HiLoSplit(8, 2, 0.5), palu_rank=8),
            KVCacheConfig(palu_rank=8, palu_hi_bit=8, palu_lo_bit=2, palu_hi_fraction=0.5),
        ),
    ]
    for by_object, by_fields in pairs:
        assert by_object == by_fields
        a, b = PaluKVCache(by_object), PaluKVCache(by_fields)
        a.update_and_fetch(x, x)
        b.update_and_fetch(x, x)
        assert a.meta_state == b.meta_state
        assert {k: np.array(v).tobytes() for k, v in a.state.items()} == {
            k: np.array(v).tobytes() for k, v in b.state.items()
        }
