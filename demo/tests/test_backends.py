"""What the chat tabs offer comes from the packages' registries, and the toggle maps onto them."""

from __future__ import annotations

import pytest

from demo.backend import DemoError, check_fits

flashcodec_tiers = pytest.importorskip("flashcodec.tiers")


@pytest.fixture(scope="module")
def flashcodec():
    from demo.flashcodec_backend import FlashcodecBackend

    return FlashcodecBackend()


@pytest.fixture(scope="module")
def palu():
    from demo.palu_backend import PaluBackend

    return PaluBackend()


def test_every_flashcodec_tier_is_offered_once(flashcodec):
    offered = flashcodec.chat_choices()
    assert offered[: len(flashcodec_tiers.TIERS)] == list(flashcodec_tiers.TIERS)  # each tier once
    assert {"hf-hqq-q8", "hf-fp8"} <= set(offered)  # transformers' QuantizedCache peers
    assert flashcodec.closest_choice in offered and flashcodec.default_choice in offered
    # the attention control offers compare's --attention choices, each tier's own first
    from flashcodec.compare import ATTENTION_CHOICES

    assert [value for value, _ in flashcodec.attention_choices] == list(ATTENTION_CHOICES)
    assert flashcodec.default_attention == "tier"


@pytest.mark.parametrize("attention", ["tier", "codes", "materialized"])
def test_every_tier_takes_every_attention(flashcodec, attention):
    for name in flashcodec_tiers.TIERS:
        flashcodec.check_choice(name, attention)  # no error


def test_the_attention_choice_on_a_peer_or_a_bad_value_is_a_message(flashcodec):
    with pytest.raises(DemoError, match="hf-fp8 is not a flashcodec tier.*png-keep1"):
        flashcodec.check_choice("hf-fp8", "codes")
    flashcodec.check_choice("hf-fp8", "tier")  # a peer with its own attention is fine
    with pytest.raises(DemoError, match=r"attention must be one of \['tier', 'codes', 'materialized'\]"):
        flashcodec.check_choice("png-keep1", "mf")


def test_a_tier_is_labelled_with_the_attention_it_was_built_with(flashcodec):
    from kvbench.protocol import Candidate

    def built(kind, attention):
        return Candidate("jpeg-k8-int8", kind, "d", lambda: None, {"attention": attention})

    assert flashcodec.cache_label(built("tier", "codes")) == "jpeg-k8-int8 (attention on the codes)"
    assert flashcodec.cache_label(built("tier", "materialized")).startswith(
        "jpeg-k8-int8 (attention on a decoded"
    )
    assert flashcodec.cache_label(built("peer", "codes")) == "jpeg-k8-int8"


def test_palu_tab_offers_every_palu_tier_and_every_registered_peer(palu):
    from palu_mlx.peers import PEERS
    from palu_mlx.tiers import TIERS

    assert palu.chat_choices() == [*TIERS, *PEERS]
    assert {"mlx-lm-q8", "mlx-lm-q4", "kivi-k4v4"} <= set(PEERS)
    assert palu.attention_choices == ()
    with pytest.raises(DemoError, match="does not apply"):
        palu.check_choice(palu.default_choice, "codes")
    with pytest.raises(DemoError, match="unknown cache"):
        palu.check_choice("no-such-tier", "tier")


def test_check_fits():
    check_fits(2048, 2048, "the prompt")
    check_fits(10**6, None, "the prompt")  # no known limit
    with pytest.raises(DemoError, match="the prompt needs 2049 positions but the model allows 2048"):
        check_fits(2049, 2048, "the prompt")
