"""``palu-mlx generate`` on the embedded model, and ``--model`` names (palu_mlx.serving)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from palu_mlx.generate import generate_main
from palu_mlx.serving import ModelNameError, resolve_model_arg

MODEL = os.environ.get("KVBENCH_EMBEDDED_MODEL") or str(
    Path(__file__).resolve().parents[3] / "benchmarks" / "model" / "tiny-qwen3"
)
needs_model = pytest.mark.skipif(not os.path.isdir(MODEL), reason="the embedded model is not checked out")


@needs_model
def test_prints_mlx_lm_figures_and_kv_bytes_and_continues_a_conversation(tmp_path, capsys):
    file = tmp_path / "conversation.safetensors"
    common = ["--model", MODEL, "--max-tokens", "12", "--prompt-cache-file", str(file), "--palu-bits", "2"]
    assert generate_main([*common, "--prompt", "The json module encodes Python objects as"]) == 0
    first = capsys.readouterr().out
    for line in ("Prompt: ", "Generation: ", "Peak memory: ", "KV cache: "):
        assert line in first
    held = re.search(r"KV cache: ([\d.]+) MB held for (\d+) tokens \(([\d.]+)x an uncompressed", first)
    assert held and int(held.group(2)) > 0
    assert file.exists()

    assert generate_main([*common, "--prompt", " and decodes them back."]) == 0
    second = capsys.readouterr().out
    prompt_tokens = int(re.search(r"Prompt: (\d+) tokens", second).group(1))
    total = int(re.search(r"held for (\d+) tokens", second).group(1))
    # only the new words went through the model; the cache holds the whole conversation
    assert prompt_tokens < 10 < int(held.group(2)) < total


@needs_model
def test_refuses_mlx_lm_cache_options_palu_replaces(capsys):
    assert generate_main(["--model", MODEL, "--kv-bits", "4"]) == 1
    assert "--kv-bits 4" in capsys.readouterr().err


def test_model_names(monkeypatch, tmp_path):
    assert resolve_model_arg(str(tmp_path)) == str(tmp_path)
    pytest.importorskip("kvbench")
    if os.path.isdir(MODEL):
        assert os.path.samefile(resolve_model_arg("tiny-qwen3"), MODEL)  # kvbench's named model
    # without kvbench: hub ids pass, named models say what to install
    monkeypatch.setitem(sys.modules, "kvbench.models", None)
    assert resolve_model_arg("owner/some-model") == "owner/some-model"
    with pytest.raises(ModelNameError, match=r"smollm2-135m.*pip install"):
        resolve_model_arg("smollm2-135m")
    with pytest.raises(ModelNameError, match="must be"):
        resolve_model_arg("")
