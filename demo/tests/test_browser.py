"""The app in a real browser, on the embedded model: a prompt typed in each chat tab, both panels
streamed, the stats table filled with measured numbers, the lossless tier's reply equal to the
native one, a second turn that prefills the first, a bad model path and an empty prompt answered
with a message, and the comparison tab's bars.

It saves the error and comparison screenshots docs/demo.md shows (``hatch run app:screenshots``
refreshes them); the chat screenshots come from the default model (test_browser_default_model.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kvbench.models import embedded_model_path

from demo.formatting import COMPARISON_HEADERS, STATS_HEADERS
from demo.tests.browser import (
    MEASURED,
    NUMBER,
    context_tokens,
    open_tab,
    pick_cache,
    reply,
    save,
    send,
    set_number,
    table,
    wait_status,
)

pytestmark = pytest.mark.slow

PROMPT = "The history of the Python language"
NEW_TOKENS = 12


def check_turn(page, key: str, cache: str) -> tuple[str, str, list[dict[str, str]]]:
    status = wait_status(page, key, "Turn 1:")
    native, compressed = reply(page, key, "native"), reply(page, key, "compressed")
    assert native and compressed, f"a panel stayed empty: {native!r} / {compressed!r} ({status})"
    rows = table(page, f"{key}-stats", STATS_HEADERS)
    assert [row["cache"] for row in rows] == ["native", cache]
    for row in rows:
        assert row["context + new tokens"].endswith(f"+ {NEW_TOKENS}"), row
        for column in MEASURED:
            assert NUMBER.search(row[column]), f"{column} of {row['cache']} is not a number: {row[column]!r}"
    assert re.fullmatch(r"\d+/\d+ \(\d+\.\d%\)", rows[1]["token match"])
    return native, compressed, rows


def test_flashcodec_chat_lossless_tier_matches_native(page):
    open_tab(page, "flashcodec (transformers)")
    pick_cache(page, "flashcodec", "png-keep1")
    set_number(page, "flashcodec-new-tokens", NEW_TOKENS)
    send(page, "flashcodec", PROMPT)
    # png-keep1's own attention is on a decoded view
    native, compressed, rows = check_turn(
        page, "flashcodec", "png-keep1 (attention on a decoded (materialized) view)"
    )
    # png-keep1 stores every delta exactly: on the embedded model its logits equal the native
    # cache's bit for bit (checked: max |difference| 0.0 over 32 greedy steps), so the text is equal
    assert compressed == native
    assert rows[1]["token match"] == f"{NEW_TOKENS}/{NEW_TOKENS} (100.0%)"

    # a second turn: each side's prompt holds the first turn (message and reply) and the new one
    send(page, "flashcodec", "And after that?")
    wait_status(page, "flashcodec", "Turn 2:")
    later = table(page, "flashcodec-stats", STATS_HEADERS)
    first_context, second_context = (context_tokens(r) for r in (rows[0], later[0]))
    assert second_context >= first_context + NEW_TOKENS, (rows[0], later[0])
    assert page.locator("#flashcodec-native [data-testid=user]").count() == 2

    # a peer, attention on the codes: a message, nothing generated
    pick_cache(page, "flashcodec", "hf-fp8")
    page.locator("#flashcodec-attention").get_by_label("on the stored codes").check()
    send(page, "flashcodec", PROMPT)
    assert "not a flashcodec tier" in wait_status(page, "flashcodec", "Error")

    # a tier, attention on the codes: its decode steps attend on the codes
    pick_cache(page, "flashcodec", "jpeg-k8-int8")
    send(page, "flashcodec", PROMPT)
    _, _, rows = check_turn(page, "flashcodec", "jpeg-k8-int8 (attention on the codes)")
    served = re.search(r"decode steps on codes: (\d+)", page.locator("#flashcodec-status").inner_text())
    layers = json.loads((embedded_model_path() / "config.json").read_text())["num_hidden_layers"]
    assert served and int(served.group(1)) == (NEW_TOKENS - 1) * layers  # every one-token call, every layer
    page.locator("#flashcodec-attention").get_by_label("the tier's own").check()


def test_palu_chat_and_user_errors(page, screenshot_dir: Path):
    open_tab(page, "palu-mlx (mlx-lm)")
    pick_cache(page, "palu", "rotation-4bit")
    set_number(page, "palu-new-tokens", NEW_TOKENS)
    send(page, "palu", PROMPT)
    check_turn(page, "palu", "rotation-4bit")

    # a model path that does not exist: a readable message in the page
    missing = "/nonexistent/model-dir"
    page.locator("#palu-model textarea").fill(missing)
    send(page, "palu", PROMPT)
    message = wait_status(page, "palu", "Error")
    assert f"model '{missing}'" in message and "Traceback" not in message
    save(page.locator("#palu-status").screenshot(), screenshot_dir / "demo-error.png")

    # the app still serves: the next mistake (an empty prompt) gets its own message
    page.locator("#palu-model textarea").fill("")
    send(page, "palu", "   ")
    assert "prompt is empty" in wait_status(page, "palu", "prompt is empty")


def test_full_comparison_draws_bars(page, screenshot_dir: Path):
    open_tab(page, "Full comparison")
    page.locator("#cmp-package").get_by_text("palu", exact=True).click()
    keep = {"rotation-4bit", "palu-2bit-scaled", "mlx-lm-q4"}
    page.locator("#cmp-caches").get_by_text("palu-2bit-scaled", exact=True).wait_for()  # palu's caches listed
    boxes = page.locator("#cmp-caches label")
    for i in range(boxes.count()):
        box = boxes.nth(i)
        if box.inner_text().strip() not in keep and box.locator("input").is_checked():
            box.click()
    set_number(page, "cmp-new-tokens", 8)
    page.locator("#cmp-prompt textarea").fill(PROMPT)
    page.locator("#cmp-run").click()
    wait_status(page, "cmp", "kvbench protocol")
    rows = table(page, "cmp-table", COMPARISON_HEADERS)
    assert [row["cache"] for row in rows] == ["baseline", "rotation-4bit", "palu-2bit-scaled", "mlx-lm-q4"]
    for row in rows:
        assert NUMBER.search(row["decode tok/s"]) and NUMBER.search(row["NLL"]), row
    assert page.locator("#cmp-plot img").count() == 1
    save(page.screenshot(full_page=True), screenshot_dir / "demo-comparison.png")
