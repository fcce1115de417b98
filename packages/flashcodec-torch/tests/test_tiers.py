"""The tier registry (flashcodec.tiers): names, order, codecs, attention, lookup, and who reads it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CODECS, random_walk
from flashcodec import CodecKVCache, JPEGCodec, PNGCodec, Tier
from flashcodec.codecs import RotatedKIVICodec
from flashcodec.kvspec_adapter import FlashCodecAdapter, conformance_tiers
from flashcodec.tiers import (
    ATTENTIONS,
    DEFAULT_TIER,
    RETIRED_ATTENTION_SUFFIX,
    TIERS,
    make_registry,
    tier,
    tier_names,
)
from kvspec import KVConfigError

#: the registry, the default first: (name, the attention it is measured with)
NAMES = {
    "kivi64r-k4v4-w64i8-s8": "codes",
    "kivi64r-k8v8-w32-s8": "codes",
    "kivi64r-k3v3-w64i8-s8z4": "codes",
    "kivi64r-k3v2-w0i8-s8z4": "codes",
    "png-keep1": "materialized",
    "jpeg-k8-int8": "codes",
    "jpeg-k2-int8": "codes",
    "jpeg-k2": "materialized",
}


def test_names_order_attention_and_codecs():
    assert tier_names() == list(TIERS) == list(NAMES)
    assert len(TIERS) <= 8  # the registry stays small: study configurations live with their benchmarks
    assert list(TIERS)[0] == DEFAULT_TIER
    assert {name: t.attention for name, t in TIERS.items()} == NAMES
    assert all(name == t.name for name, t in TIERS.items())
    assert TIERS["png-keep1"].codec == PNGCodec(8, keep_ratio=1.0, delta_dtype=torch.float64)
    assert TIERS["jpeg-k8-int8"].codec == JPEGCodec(8, 8, 8)
    assert TIERS["jpeg-k2-int8"].codec == JPEGCodec(8, 2, 8)
    assert TIERS["jpeg-k2"].codec == JPEGCodec(8, 2)
    assert TIERS[DEFAULT_TIER].codec == RotatedKIVICodec(64, key_bits=4, value_bits=4, side_bits=8)


def test_every_description_is_one_line():
    for name in NAMES:
        t = tier(name)
        assert t.description and "\n" not in t.description and len(t.description) < 120, name


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_attention_is_a_field_the_lookup_sets(name, attention):
    t = tier(name, attention)
    assert (t.name, t.codec, t.attention) == (name, TIERS[name].codec, attention)
    assert tier(name) is TIERS[name]  # no attention given: the tier's own


@pytest.mark.parametrize("name", ["kivi64r-k4v4-w64i8-s8", "png-keep1", "jpeg-k4"])
def test_a_name_with_the_retired_attention_suffix_says_to_choose_the_attention(name):
    with pytest.raises(KVConfigError, match=r"no longer part of a tier's name.*attention='codes'"):
        tier(name + RETIRED_ATTENTION_SUFFIX)


def test_a_tier_cannot_be_named_with_the_retired_suffix():
    with pytest.raises(KVConfigError, match="attention is no longer part"):
        Tier("a" + RETIRED_ATTENTION_SUFFIX, "x", PNGCodec())


def test_a_registry_refuses_a_repeated_name_and_a_non_tier():
    with pytest.raises(KVConfigError, match="defined twice"):
        make_registry(Tier("a", "x", PNGCodec()), Tier("a", "y", PNGCodec()))
    with pytest.raises(KVConfigError, match="Tier objects"):
        make_registry(PNGCodec())


def test_lookup_in_another_registry():
    own = Tier("own", "a caller's", JPEGCodec(8, 4), "materialized")
    registry = make_registry(*TIERS.values(), own)
    assert tier("own", registry=registry) is own
    assert tier("own", "codes", registry=registry).attention == "codes"
    with pytest.raises(KVConfigError, match="tier must be one of"):
        tier("own")


@pytest.mark.parametrize("name", NAMES)
def test_every_tier_builds_a_cache(name):
    x = random_walk(s=19)
    cache = CodecKVCache(codec=tier(name).codec)
    k, _ = cache.update_and_fetch(x, x)
    assert k.shape == x.shape and cache.nbytes > 0


@pytest.mark.parametrize("name", CODECS)
def test_a_codec_says_its_synthesis_is_the_identity_only_when_it_is(name):
    # the kernels skip the synthesis product on the codec's word (synthesis_is_identity)
    codec = CODECS[name]
    a = codec.synthesis_matrix()
    is_eye = a.shape[0] == a.shape[1] and torch.equal(a, torch.eye(a.shape[0]))
    assert codec.synthesis_is_identity == is_eye


def test_unknown_tier_lists_the_names():
    with pytest.raises(
        KVConfigError, match=r"tier must be one of \['kivi64r-k4v4-w64i8-s8', .*'jpeg-k2'\]; got 'jpeg-k3'"
    ):
        tier("jpeg-k3")
    with pytest.raises(ValueError):  # KVConfigError is a ValueError
        tier(None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="", description="x", codec=PNGCodec()), "name"),
        (dict(name="a", description="two\nlines", codec=PNGCodec()), "description"),
        (dict(name="a", description="x", codec={"mode": "png"}), "codec"),
        (dict(name="a", description="x", codec=PNGCodec(), attention="mf"), r"attention must be one of \("),
        (dict(name="a", description="x", codec=PNGCodec(), attention=True), "attention must be one of"),
    ],
    ids=["name", "description", "codec", "attention-word", "attention-bool"],
)
def test_tier_fields_are_checked(kwargs, match):
    with pytest.raises(KVConfigError, match=match):
        Tier(**kwargs)


def test_with_attention_checks_its_argument():
    with pytest.raises(KVConfigError, match="attention must be one of"):
        TIERS["png-keep1"].with_attention("both")
    with pytest.raises(dataclasses.FrozenInstanceError):
        TIERS["png-keep1"].attention = "codes"  # a registry tier never changes in place


def test_the_conformance_adapter_reads_the_registry():
    cases = FlashCodecAdapter().configs()
    assert [c.name for c in cases] == conformance_tiers() == list(NAMES)
    assert all(c.config is TIERS[c.name].codec for c in cases)


def test_the_test_codecs_hold_every_registry_codec():
    assert {n: CODECS[n] for n in TIERS} == {n: t.codec for n, t in TIERS.items()}
