"""Fixtures of the palu-mlx tests; helpers live in palu_helpers.py."""

from __future__ import annotations

import pytest
from mlx_lm.models import qwen3
from palu_helpers import make_tiny_qwen3


@pytest.fixture(scope="session")
def tiny_model() -> qwen3.Model:
    return make_tiny_qwen3()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still runs by default)")
