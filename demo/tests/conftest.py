"""Fixtures of the app's tests: the served app (a subprocess on a free port) and a Chromium page.

The browser is the system's Chromium (Debian's ``chromium`` package, which ``.ci/run`` installs),
driven by Playwright without Playwright's own browser download. Without it the browser test
skips on a developer machine, but fails under CI (``CI`` set), where it must run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from demo.tests.browser import browser_page, chromium, served_app


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


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model's directory when it is already converted here (tests never fetch it:
    on CI the benchmarks' tests convert it from its registry wheel before the app's tests run)."""
    from kvbench.model_store import kvbench_home
    from kvbench.models import DEFAULT_MODEL

    path = kvbench_home() / "models" / DEFAULT_MODEL
    if not (path / "config.json").is_file():
        pytest.skip(f"{DEFAULT_MODEL} is not converted on this machine (kvbench makes it on first use)")
    return path


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
    """The app on the embedded model: quick to load and run, and what the browser test's checks
    were measured on (the default model's conversation has its own test)."""
    with served_app("tiny-qwen3", tmp_path_factory.mktemp("app")) as url:
        yield url


@pytest.fixture(scope="session")
def browser(browser_executable: str):
    """The system's Chromium, shared by every browser test of the session."""
    with chromium(browser_executable) as launched:
        yield launched


@pytest.fixture(scope="session")
def page(app_url: str, browser):
    """A Chromium page on the embedded model's app."""
    with browser_page(browser, app_url) as page:
        yield page
