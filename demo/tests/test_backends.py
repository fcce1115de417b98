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


def test_every_flashcodec_tier_is_reachable_from_the_chat_tab(flashcodec):
    offered = flashcodec.chat_choices()
    with_toggle = [flashcodec.resolve(n, True) for n in offered if n in flashcodec_tiers.TIERS]
    reachable = set(offered) | set(with_toggle)
    assert set(flashcodec_tiers.tier_names()) <= reachable  # every listed -mf name too
    assert {"hf-hqq-q8", "hf-fp8"} <= reachable  # transformers' QuantizedCache peers
    assert flashcodec.closest_choice in reachable and flashcodec.default_choice in reachable
    assert not any(n.endswith("-mf") for n in offered)  # each stored format once


def test_the_toggle_is_the_attention_axis_of_the_same_tier(flashcodec):
    assert flashcodec.resolve("jpeg-k8-int8", True) == "jpeg-k8-int8-mf"
    assert flashcodec.resolve("jpeg-k2-int8", True) == "jpeg-k2-int8-mf"
    assert flashcodec.resolve("jpeg-k2-int8", False) == "jpeg-k2-int8"
    for name in flashcodec_tiers.TIERS:
        on = flashcodec_tiers.tier(flashcodec.resolve(name, True))
        assert on.materialization_free and on.codec == flashcodec_tiers.TIERS[name].codec


def test_the_toggle_on_a_peer_is_a_message(flashcodec):
    with pytest.raises(DemoError, match="hf-fp8 is not a flashcodec tier.*png-keep1"):
        flashcodec.resolve("hf-fp8", True)


def test_palu_tab_offers_every_palu_tier_and_every_registered_peer(palu):
    from palu_mlx.peers import PEERS
    from palu_mlx.tiers import TIERS

    assert palu.chat_choices() == [*TIERS, *PEERS]
    assert {"mlx-lm-q8", "mlx-lm-q4", "kivi-k4v4"} <= set(PEERS)
    assert not palu.has_materialization_free
    with pytest.raises(DemoError, match="does not apply"):
        palu.resolve("palu-3bit", True)
    with pytest.raises(DemoError, match="unknown cache"):
        palu.resolve("no-such-tier", False)


def test_check_fits():
    check_fits(2048, 2048, "the prompt")
    check_fits(10**6, None, "the prompt")  # no known limit
    with pytest.raises(DemoError, match="the prompt needs 2049 positions but the model allows 2048"):
        check_fits(2049, 2048, "the prompt")
