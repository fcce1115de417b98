"""Every ```python snippet in README.md, docs/ and the packages' READMEs runs as written.

The blocks of one file run in order in one namespace (as a reader would paste them into one
session), in a scratch folder, on the embedded model: hub ids and the placeholder model names are
swapped for its path, and ``.cuda()`` for nothing (this machine has no GPU). Nothing else changes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "packages").glob("*/README.md")])
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
#: model names a reader replaces with their own: hub ids and the placeholders the docs use
MODEL_NAME = re.compile(
    r"""(["'])(?:Qwen/[\w.-]+|mlx-community/[\w.-]+|meta-llama/[\w.-]+|path/or/hf-id)\1"""
)


#: packages a snippet may need that the test environments leave out on purpose, with where they run
ELSEWHERE = {"vllm": "vLLM runs in its own environment (docs/serving.md says how to make it)"}
IMPORTS = re.compile(r"^(?:from|import) (\w+)", re.MULTILINE)


def snippets(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


def runnable(code: str, model_path: Path) -> str:
    code = MODEL_NAME.sub(repr(str(model_path)), code)
    return code.replace(".cuda()", "")


WITH_SNIPPETS = [f for f in FILES if snippets(f)]


def test_the_docs_have_snippets():
    assert {f.name for f in WITH_SNIPPETS} >= {"README.md", "flashcodec.md", "palu-mlx.md", "kvspec.md"}


@pytest.mark.slow
@pytest.mark.parametrize("path", WITH_SNIPPETS, ids=[str(f.relative_to(ROOT)) for f in WITH_SNIPPETS])
def test_snippets_run_as_written(path, model_path, tmp_path, monkeypatch):
    import torch

    for module in sorted({m for code in snippets(path) for m in IMPORTS.findall(code)} & ELSEWHERE.keys()):
        pytest.importorskip(module, reason=f"{path.name} needs {module}: {ELSEWHERE[module]}")
    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__snippet__"}
    for index, code in enumerate(snippets(path)):
        source = runnable(code, model_path)
        try:
            exec(compile(source, f"{path.name}[{index}]", "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"{path.relative_to(ROOT)} snippet {index} failed: {err!r}\n{code}") from err
    assert os.getcwd() == str(tmp_path)
