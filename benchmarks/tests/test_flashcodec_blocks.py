"""docs/flashcodec.md's generated blocks: each comes from its results file, in the page as rendered."""

from __future__ import annotations

from pathlib import Path

import pytest
from flashcodec_blocks import BLOCKS
from kvbench.results import read_json

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "flashcodec.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.results_file)
def test_each_block_is_in_the_page_as_its_results_file_renders_it(block):
    result = read_json(ROOT / "benchmarks" / "results" / block.results_file)
    text = block.text(result)
    assert PAGE.count(block.start) == 1 and PAGE.count(block.end) == 1
    assert text in PAGE, f"run: python benchmarks/tools/make_docs.py ({block.results_file} changed)"


def test_a_figure_of_the_file_is_the_figure_in_the_table():
    block = next(b for b in BLOCKS if b.results_file == "flashcodec_e2e.json")
    result = read_json(ROOT / "benchmarks" / "results" / block.results_file)
    baseline = result["results"]["baseline"]
    result["results"]["baseline"] = {**baseline, "decode_tokens_per_s": 12345.6}
    assert "| `baseline` | 12345.6 |" in block.text(result)
