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


def test_a_tier_is_shown_with_its_attention_whatever_its_file_recorded():
    from flashcodec.tiers import RETIRED_ATTENTION_SUFFIX
    from flashcodec_blocks import row_attention, shown_name, with_shown_names

    codes = "kivi64r-k4v4-w64i8-s8 (attention on the codes)"
    # files written before attention was a field: a name suffix, or the materialization_free flag
    assert shown_name("kivi64r-k4v4-w64i8-s8" + RETIRED_ATTENTION_SUFFIX) == codes
    assert row_attention({"config": {"materialization_free": False}}) == "materialized"
    assert row_attention({"materialization_free": True}) == "codes"
    # files written since: the attention field, in the row or its config
    assert shown_name("kivi64r-k4v4-w64i8-s8", row_attention({"config": {"attention": "codes"}})) == codes
    assert shown_name("png-keep1", row_attention({"attention": "materialized"})) == (
        "png-keep1 (attention on a decoded view)"
    )
    assert shown_name("hf-hqq-q4", row_attention({"config": {"nbits": 4}})) == "hf-hqq-q4"
    result = {"runs": [{"rows": [
        {"name": "baseline", "kind": "baseline"},
        {"name": "jpeg-k2", "kind": "tier", "config": {"attention": "codes"}},
        {"name": "hf-hqq-q4", "kind": "peer", "config": {"attention": "codes"}},
    ]}]}  # fmt: skip
    shown = [r["name"] for r in with_shown_names(result)["runs"][0]["rows"]]
    assert shown == ["baseline", "jpeg-k2 (attention on the codes)", "hf-hqq-q4"]
    assert result["runs"][0]["rows"][1]["name"] == "jpeg-k2"  # the result itself is left as read


def test_no_generated_page_shows_a_retired_attention_suffix():
    from flashcodec.tiers import RETIRED_ATTENTION_SUFFIX

    for page in ("README.md", "docs/benchmarks.md", "docs/flashcodec.md", "docs/kvbench.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        assert f"{RETIRED_ATTENTION_SUFFIX}`" not in text and f"{RETIRED_ATTENTION_SUFFIX} |" not in text, (
            page
        )
        assert f"{RETIRED_ATTENTION_SUFFIX}," not in text, page
