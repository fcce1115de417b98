"""Shared fixtures for the benchmark-side tests (run in the ``bench`` environment).

``benchmarks/model`` and ``benchmarks/tools`` are put on ``sys.path`` so tests import ``corpus``,
``capture_kv`` and ``make_docs`` the way the scripts do. The embedded model is located only through
``kvbench.models.embedded_model_path`` (the one place that knows where it lives).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1]
for folder in (BENCH_DIR / "model", BENCH_DIR / "tools"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still runs by default)")


@pytest.fixture(scope="session")
def training_record() -> dict:
    """``benchmarks/results/tiny_model_training.json``, written by ``train_tiny_model.py``."""
    return json.loads((BENCH_DIR / "results" / "tiny_model_training.json").read_text())


@pytest.fixture(scope="session")
def model_path() -> Path:
    """Directory of the embedded tiny qwen3 (config.json, model.safetensors, tokenizer files)."""
    from kvbench.models import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def torch_model(model_path):
    """The embedded model loaded by transformers, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # tests share 2 cores with other suites
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
