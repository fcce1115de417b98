"""The one-line description of a palu config that the server and generate commands log."""

from __future__ import annotations

from palu_mlx import KVCacheConfig
from palu_mlx.serving import describe
from palu_mlx.tiers import TIERS


def test_the_default_says_its_code_bits_and_exact_tokens():
    line = describe(KVCacheConfig())
    assert "4 bits per rotated key channel and 3 per value channel" in line
    assert "per-token scales, first 4 tokens exact, newest 32 in int8" in line
    assert "nothing fitted" in line and "weighed" not in line


def test_the_fitted_default_says_its_bits_weighing_and_exact_tokens():
    line = describe(KVCacheConfig(method="palu"))
    assert "2.25 code bits per element" in line
    assert "weighed by relative error" in line
    assert "first 4 and newest 32 tokens exact" in line


def test_a_compact_tier_says_its_newest_tokens_are_int8_not_exact():
    line = describe(TIERS["palu-1.75bit-compact"].config)
    assert "newest 32 in int8" in line and "newest 32 tokens exact" not in line
    assert "weighed by squared error" in line


def test_the_reference_split_names_no_weighing():
    line = describe(TIERS["reference-default"].config)
    assert "rank / hi-lo split" in line and "weighed" not in line
