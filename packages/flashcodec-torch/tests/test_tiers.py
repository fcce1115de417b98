"""The tier registry (flashcodec.tiers): names, order, codecs, lookup, and who reads it."""

from __future__ import annotations

import pytest
import torch
from conftest import CODECS, random_walk
from flashcodec import CodecKVCache, JPEGCodec, PNGCodec, Tier
from flashcodec.codecs import ChannelInt4Codec, ZeroPointJPEGCodec
from flashcodec.kvspec_adapter import FlashCodecAdapter, conformance_tiers
from flashcodec.tiers import TIERS, tier, tier_names
from kvspec import KVConfigError

#: the names command lines list (flashcodec.tiers.tier_names): each -mf name right after its tier
NAMES = [
    "png-keep1",
    "jpeg-k8",
    "jpeg-k8-int8",
    "jpeg-k8-int8-mf",
    "jpeg-k8-int4",
    "jpeg-k8-int4-mf",
    "jpeg-k8-int4z",
    "jpeg-k8-int4z-mf",
    "jpeg-k8-int4z-w64",
    "jpeg-k8-int4z-w64-mf",
    "jpeg-k8-int4z-w96i8",
    "jpeg-k8-int4z-w96i8-mf",
    "chan64-int4-w64i8",
    "chan64-int4-w64i8-mf",
    "kivi64-k8v8-w64i8",
    "kivi64-k8v8-w64i8-mf",
    "kivi64-k4v4-w64i8",
    "kivi64-k4v4-w64i8-mf",
    "kivi64r-k4v4-w64i8",
    "kivi64r-k4v4-w64i8-mf",
    "kivi64r-k3v3-w64i8",
    "kivi64r-k3v3-w64i8-mf",
    "kivi64r-k3v2-w64i8",
    "kivi64r-k3v2-w64i8-mf",
    "kivi64r-k4v4-w64i8-s8",
    "kivi64r-k4v4-w64i8-s8-mf",
    "kivi64r-k3v3-w64i8-s8z4",
    "kivi64r-k3v3-w64i8-s8z4-mf",
    "kivi64r-k3v2-w64i8-s8z4",
    "kivi64r-k3v2-w64i8-s8z4-mf",
    "kivi64r-k8v8-w32-s8",
    "kivi64r-k8v8-w32-s8-mf",
    "kivi64r-k3v3-w0i8-s8",
    "kivi64r-k3v3-w0i8-s8-mf",
    "kivi64r-k3v2-w0i8-s8z4",
    "kivi64r-k3v2-w0i8-s8z4-mf",
    "kivi64r-k3v2-w0i8-s8z4-vs1",
    "kivi64r-k3v2-w0i8-s8z4-vs1-mf",
    "jpeg-k4",
    "jpeg-k2",
    "jpeg-k2-int8",
    "jpeg-k2-int8-mf",
]
STORAGE = [n for n in NAMES if not n.endswith("-mf")]


def test_names_order_and_codecs():
    assert tier_names() == NAMES
    assert list(TIERS) == STORAGE  # the registry holds each storage format once
    assert all(name == t.name and not t.materialization_free for name, t in TIERS.items())
    assert TIERS["png-keep1"].codec == PNGCodec(8, keep_ratio=1.0, delta_dtype=torch.float64)
    assert TIERS["jpeg-k8"].codec == JPEGCodec(8, 8)
    assert TIERS["jpeg-k2-int8"].codec == JPEGCodec(8, 2, 8)
    assert TIERS["jpeg-k8-int4"].codec == JPEGCodec(8, 8, 4)
    assert TIERS["jpeg-k8-int4z"].codec == ZeroPointJPEGCodec(8, 8)
    assert TIERS["jpeg-k8-int4z-w64"].codec == ZeroPointJPEGCodec(8, 8, raw_window=64)
    assert TIERS["jpeg-k8-int4z-w96i8"].codec == ZeroPointJPEGCodec(8, 8, raw_window=96, window_bits=8)
    assert TIERS["chan64-int4-w64i8"].codec == ChannelInt4Codec(64, raw_window=64, window_bits=8)


def test_every_description_is_one_line():
    for name in NAMES:
        t = tier(name)
        assert t.description and "\n" not in t.description and len(t.description) < 120, name


@pytest.mark.parametrize("name", [*NAMES, "png-keep1-mf", "jpeg-k4-mf"])
def test_the_mf_suffix_is_the_attention_axis_of_any_tier(name):
    t = tier(name)
    base = TIERS[name.removesuffix("-mf")]
    assert t.name == name and t.codec == base.codec
    assert t.materialization_free == name.endswith("-mf")


def test_the_registry_refuses_an_mf_name():
    from flashcodec.tiers import _registry

    with pytest.raises(KVConfigError, match="attention axis"):
        _registry(Tier("a-mf", "x", PNGCodec()))


@pytest.mark.parametrize("name", NAMES)
def test_every_tier_builds_a_cache(name):
    x = random_walk(s=19)
    cache = CodecKVCache(codec=tier(name).codec)
    k, _ = cache.update_and_fetch(x, x)
    assert k.shape == x.shape and cache.nbytes > 0


@pytest.mark.parametrize("name", NAMES)
def test_a_codec_says_its_synthesis_is_the_identity_only_when_it_is(name):
    # the kernels skip the synthesis product on the codec's word (synthesis_is_identity)
    codec = tier(name).codec
    a = codec.synthesis_matrix()
    is_eye = a.shape[0] == a.shape[1] and torch.equal(a, torch.eye(a.shape[0]))
    assert codec.synthesis_is_identity == is_eye


def test_unknown_tier_lists_the_names():
    with pytest.raises(
        KVConfigError, match=r"tier must be one of \['png-keep1', .*'jpeg-k2-int8-mf'\] .*; got 'jpeg-k3'"
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
        (dict(name="a", description="x", codec=PNGCodec(), materialization_free=1), "materialization_free"),
        (dict(name="a", description="x", codec=PNGCodec(), offer_mf="yes"), "offer_mf"),
    ],
    ids=["name", "description", "codec", "materialization-free", "offer-mf"],
)
def test_tier_fields_are_checked(kwargs, match):
    with pytest.raises(KVConfigError, match=match):
        Tier(**kwargs)


def test_the_conformance_adapter_reads_the_registry():
    cases = FlashCodecAdapter().configs()
    assert [c.name for c in cases] == conformance_tiers() == STORAGE
    assert all(c.config is TIERS[c.name].codec for c in cases)


def test_the_test_codecs_are_the_registry_codecs_plus_top_m_and_mixed_bits():
    assert {n: c for n, c in CODECS.items() if n not in ("png-keep0.5", "jpeg-mixed-84")} == {
        n: t.codec for n, t in TIERS.items()
    }


def test_compare_moves_the_selected_tiers_along_the_attention_axis():
    pytest.importorskip("kvbench")
    from flashcodec.compare import on_attention_axis
    from kvbench.results import CompareError

    names = ["png-keep1", "jpeg-k2-int8-mf", "jpeg-k2-int8"]
    assert on_attention_axis(names, "as-named") == names
    assert on_attention_axis(names, "codes") == ["png-keep1-mf", "jpeg-k2-int8-mf"]
    assert on_attention_axis(names, "materialized") == ["png-keep1", "jpeg-k2-int8"]
    assert all(tier(n).materialization_free for n in on_attention_axis(names, "codes"))
    with pytest.raises(CompareError, match="--attention must be one of"):
        on_attention_axis(names, "both")
