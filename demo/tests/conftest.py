"""Fixtures of the app's tests: the served app (a subprocess on a free port) and a Chromium page.

The browser is the system's Chromium (Debian's ``chromium`` package, which ``.ci/run`` installs),
driven by Playwright without Playwright's own browser download. Without it the browser test
skips on a developer machine, but fails under CI (``CI`` set), where it must run.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300  # both models load and warm up before the page is served; CI's 2 cores are slow


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still runs by default)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--screenshots",
        default=None,
        metavar="DIR",
        help="where the browser test saves its screenshots (default: a temporary directory); "
        "docs/images to refresh the ones docs/demo.md shows",
    )


def chromium_path() -> str | None:
    """The system Chromium: $CHROMIUM, else chromium / chromium-browser on PATH."""
    named = os.environ.get("CHROMIUM")
    if named:
        return named if Path(named).is_file() else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def screenshot_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    chosen = request.config.getoption("--screenshots")
    out = Path(chosen) if chosen else tmp_path_factory.mktemp("screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="session")
def browser_executable() -> str:
    path = chromium_path()
    if path is None:
        message = "no Chromium found (install Debian's chromium, or set CHROMIUM to its executable)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}: under CI the browser test must run")
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def app_url(tmp_path_factory: pytest.TempPathFactory, browser_executable: str):
    """``hatch run chat``'s app, served on a free port for the session: its URL."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("app") / "app.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            # the embedded model: quick to load and run, and what the browser test's checks were
            # measured on (the default model's conversation is tested in test_models.py)
            [sys.executable, "-m", "demo", "--model", "tiny-qwen3", "--port", str(port)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the app exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the app did not serve within {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}"
                )
            time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def page(app_url: str, browser_executable: str):
    """A Chromium page on the app (1280 px wide, as the docs' screenshots)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        browser = playwright.chromium.launch(executable_path=browser_executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(60_000)
            page.goto(app_url)
            yield page
        finally:
            browser.close()
