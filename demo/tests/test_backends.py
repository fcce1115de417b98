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
    from demo.flashcodec_backend import materialization_free_twin

    offered = flashcodec.chat_choices()
    tiers = flashcodec_tiers.TIERS
    with_toggle = [
        flashcodec.resolve(n, True) for n in offered if n in tiers and materialization_free_twin(n)
    ]
    reachable = set(offered) | set(with_toggle)
    assert set(flashcodec_tiers.TIERS) <= reachable
    assert {"hf-hqq-q8", "hf-fp8"} <= reachable  # transformers' QuantizedCache peers
    assert flashcodec.closest_choice in reachable and flashcodec.default_choice in reachable


def test_the_toggle_picks_the_tier_with_the_same_codec(flashcodec):
    assert flashcodec.resolve("jpeg-k8-int8", True) == "jpeg-k8-int8-mf"
    assert flashcodec.resolve("jpeg-k2-int8", True) == "jpeg-k2-int8-mf"
    assert flashcodec.resolve("jpeg-k2-int8", False) == "jpeg-k2-int8"
    tiers = flashcodec_tiers.TIERS
    for name in flashcodec.chat_choices():
        if name in tiers and (twin := flashcodec.resolve(name, False)) != name:
            assert tiers[twin].codec == tiers[name].codec


@pytest.mark.parametrize("name", ["png-keep1", "hf-fp8"])
def test_the_toggle_on_a_cache_without_a_twin_is_a_message(flashcodec, name):
    with pytest.raises(DemoError, match="no materialization-free tier.*jpeg-k8-int8"):
        flashcodec.resolve(name, True)


def test_palu_tab_offers_every_palu_tier_and_mlx_lm_quantized_cache(palu):
    from palu_mlx.tiers import TIERS

    assert palu.chat_choices() == [*TIERS, "mlx-lm-q8", "mlx-lm-q4"]
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
