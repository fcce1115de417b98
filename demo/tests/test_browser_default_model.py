"""The app in a real browser on the default model (SmolLM2-135M-Instruct), as ``hatch run chat``
starts it: in each chat tab the cache the tab offers first holds a two-turn conversation beside
the native cache, both panels naming the right capitals, and the second prompt holding the first
turn. Its screenshots are the chat pictures docs/demo.md shows (``hatch run app:screenshots``).

Skipped where the default model is not converted yet (tests never fetch it; on CI the benchmarks'
tests convert it from its registry wheel first).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvbench.models import DEFAULT_MODEL

from demo.flashcodec_backend import FlashcodecBackend
from demo.formatting import STATS_HEADERS
from demo.palu_backend import PaluBackend
from demo.tests import browser as ui

pytestmark = pytest.mark.slow

NEW_TOKENS = 24  # enough for a one-sentence answer, which ends at <|im_end|> before that
TABS = {
    # tab key: (tab title, the cache it offers first, how the stats table names it)
    "flashcodec": (
        "flashcodec (transformers)",
        FlashcodecBackend.default_choice,
        f"{FlashcodecBackend.default_choice} (attention on the codes)",  # the default tier's own attention
    ),
    "palu": ("palu-mlx (mlx-lm)", PaluBackend.default_choice, PaluBackend.default_choice),
}


@pytest.fixture(scope="module")
def default_page(default_model_dir: Path, browser, tmp_path_factory: pytest.TempPathFactory):
    # by name, as ``hatch run chat`` opens it (the fixture only checks it is converted here)
    with ui.served_app(DEFAULT_MODEL, tmp_path_factory.mktemp("default-app")) as url:
        with ui.browser_page(browser, url) as page:
            yield page


def replies(page, key: str) -> tuple[str, str]:
    return ui.reply(page, key, "native"), ui.reply(page, key, "compressed")


@pytest.mark.parametrize("key", list(TABS))
def test_each_tab_holds_a_conversation_with_its_first_cache(default_page, key: str, screenshot_dir: Path):
    page = default_page
    title, cache, label = TABS[key]
    ui.open_tab(page, title)
    ui.pick_cache(page, key, cache)
    ui.set_number(page, f"{key}-new-tokens", NEW_TOKENS)

    ui.send(page, key, "What is the capital of France?")
    ui.wait_status(page, key, "Turn 1:")
    for side, text in zip(("native", "compressed"), replies(page, key), strict=True):
        assert "Paris" in text, f"{side} panel: {text!r}"
    first = ui.table(page, f"{key}-stats", STATS_HEADERS)
    assert first[1]["cache"] == label

    ui.send(page, key, "And of Italy?")
    ui.wait_status(page, key, "Turn 2:")
    for side, text in zip(("native", "compressed"), replies(page, key), strict=True):
        assert "Rome" in text, f"{side} panel: {text!r}"
    second = ui.table(page, f"{key}-stats", STATS_HEADERS)
    assert ui.context_tokens(second[0]) > ui.context_tokens(first[0])  # the first turn is in the prompt
    assert page.locator(f"#{key}-compressed [data-testid=user]").count() == 2
    ui.save(page.screenshot(full_page=True), screenshot_dir / f"demo-{key}.png")
