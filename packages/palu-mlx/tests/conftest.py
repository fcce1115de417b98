"""Fixtures of the palu-mlx tests; helpers live in palu_helpers.py."""

from __future__ import annotations

import os

import mlx_lm
import pytest
from hypothesis import HealthCheck, settings
from mlx_lm.models import qwen3
from palu_helpers import make_tiny_qwen3

# Property tests (test_properties.py): "ci" (the default) keeps the suite fast on a
# shared 2-core box and deterministic; HYPOTHESIS_PROFILE=thorough runs many more random sequences.
settings.register_profile(
    "ci", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def embedded_path():
    """The embedded tiny model's directory (kvbench finds it), loaded once to prove it loads; the
    tests that run a command on a real model directory skip without it."""
    try:
        from kvbench.models import embedded_model_path

        path = embedded_model_path()
        mlx_lm.load(str(path))
    except Exception as exc:  # noqa: BLE001 - no kvbench or no model: nothing to run the command on
        pytest.skip(f"embedded model not available: {exc}")
    return path


@pytest.fixture(scope="session")
def tiny_model() -> qwen3.Model:
    return make_tiny_qwen3()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still runs by default)")
