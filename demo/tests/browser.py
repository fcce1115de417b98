"""What the browser tests do on a page of the app: open a tab, pick a cache, send a message, wait
for a turn, read a panel or a table, save a screenshot for the docs."""

from __future__ import annotations

import io
import re
import sys
from contextlib import contextmanager
from pathlib import Path

from kvbench.process import free_port, served

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300  # both models load and warm up before the page is served; CI's 2 cores are slow

TURN_TIMEOUT_MS = 300_000  # one turn: two sides of 12 tokens on CI's 2 cores, with headroom
NUMBER = re.compile(r"\d+(\.\d+)?")
# columns of the stats table whose every cell must hold a measured number
MEASURED = ("KV held", "KV resident", "peak memory", "steady memory", "prefill", "per token (median)")


def save(png: bytes, path: Path) -> None:
    """A screenshot as a 64-colour PNG (a few times smaller; the UI has few colours), for the docs."""
    from PIL import Image

    Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=64).save(path, optimize=True)


def open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name, exact=True).click()


def pick_cache(page, key: str, name: str) -> None:
    page.locator(f"#{key}-cache input").click()
    page.get_by_role("option", name=name, exact=True).click()
    assert page.locator(f"#{key}-cache input").input_value() == name


def set_number(page, elem_id: str, value: int) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def send(page, key: str, text: str) -> None:
    page.locator(f"#{key}-message textarea").fill(text)
    page.locator(f"#{key}-send").click()


def wait_status(page, key: str, text: str, timeout: int = TURN_TIMEOUT_MS) -> str:
    status = page.locator(f"#{key}-status")
    status.get_by_text(text).wait_for(timeout=timeout)
    return status.inner_text()


def reply(page, key: str, side: str) -> str:
    return page.locator(f"#{key}-{side} [data-testid=bot]").last.inner_text().strip()


def table(page, elem_id: str, headers: list[str]) -> list[dict[str, str]]:
    rows = []
    r = 0
    while page.locator(f"#{elem_id} [data-testid=cell-{r}-0]").count():
        cells = [
            page.locator(f"#{elem_id} [data-testid=cell-{r}-{c}]").inner_text().strip()
            for c in range(len(headers))
        ]
        rows.append(dict(zip(headers, cells, strict=True)))
        r += 1
    return rows


def context_tokens(row: dict[str, str]) -> int:
    """The prefilled tokens of a stats row ("context + new tokens": "37 + 12")."""
    return int(row["context + new tokens"].split("+")[0].strip().replace(",", ""))


@contextmanager
def served_app(model: str, log_dir: Path):
    """``hatch run chat``'s app on ``model``, served on a free port while the block runs: its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    command = [sys.executable, "-m", "demo", "--model", model, "--port", str(port)]
    with served(command, url, log_dir / "app.log", timeout_s=START_TIMEOUT_S, cwd=ROOT, name="the app"):
        yield url


@contextmanager
def chromium(executable: str):
    """The system's Chromium under Playwright: one per test session (Playwright's sync API runs
    one instance at a time)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def browser_page(browser, url: str):
    """A page of ``browser`` on ``url`` (1280 px wide, as the docs' screenshots)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.set_default_timeout(60_000)
        page.goto(url)
        yield page
    finally:
        page.close()
