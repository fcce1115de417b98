"""docs/palu-mlx.md's and docs/benchmarks.md's generated palu blocks: what each says from its file."""

from __future__ import annotations

import copy
from pathlib import Path

from kvbench.results import read_json
from long_run_block import _palu
from palu_long_block import PALU_LONG_REAL_FILE, render_palu_long_block
from palu_speed_block import PALU_SPEED_END, PALU_SPEED_START, render_palu_speed_block

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _speed() -> dict:
    return read_json(RESULTS / "palu_decode_speed.json")


def test_the_speed_block_shows_each_file_with_its_decode_dtype_and_same_round_ratio():
    fp32 = _speed()
    bf16 = copy.deepcopy(fp32)
    bf16["decode_dtype"] = "bfloat16"
    context = next(iter(bf16["contexts"]))
    row = bf16["contexts"][context]["candidates"][f"{bf16['tier']} (packed)"]
    row["vs_q4_median_of_rounds"] = 1.23
    text = render_palu_speed_block({"palu_decode_speed.json": fp32, "palu_decode_speed_bf16.json": bf16})
    assert text.startswith(PALU_SPEED_START) and text.endswith(PALU_SPEED_END)
    assert "**Decode in float32**" in text and "**Decode in bfloat16**" in text
    assert f"`{bf16['tier']}` decodes at 1.23x q4's tokens/s at {int(context):,} tokens" in text
    only = render_palu_speed_block({"palu_decode_speed.json": fp32})
    assert "**Decode in bfloat16**" not in only


def test_the_peak_target_line_says_met_only_at_or_under_the_target():
    result = read_json(RESULTS / PALU_LONG_REAL_FILE)
    longest = max(result["contexts"], key=int)
    name = next(n for n in result["contexts"][longest] if n.startswith("palu-"))
    for peak, verdict in ((0.5, "met"), (0.51, "not met")):
        edited = copy.deepcopy(result)
        edited["contexts"][longest][name]["peak_vs_q4"] = peak
        text = render_palu_long_block(edited, peak_target=0.5)
        assert f"`{name}` holds" in text and f"peaks at {peak:.2f}x q4's peak" in text
        line = next(line for line in text.splitlines() if f"`{name}` holds" in line)
        assert line.endswith(f": {verdict}).")
    assert "one decode step peaks at" not in render_palu_long_block(result)  # no target, no line


_SETUP = {
    "model": {"name": "smollm2-135m"},
    "windows": 16,
    "context_tokens": 1792,
    "scored_tokens": 256,
    "step_tokens": 32,
}
_BASELINE = {"ppl": 11.29, "bytes_x_raw": 1.06, "bytes_x_q4": None}


def test_a_palu_long_run_that_has_not_reached_q4_renders_with_its_q4_columns_empty():
    partial = {"date": "2026-12-02T00:00:00+00:00", "setup": _SETUP, "rows": {"baseline": _BASELINE}}
    text = "\n".join(_palu(partial))
    assert "| `baseline` | 1.060 | – | 0 | – |  | 100.0% | 11.29 |  |  |" in text
    assert "Not run yet: mlx-lm-q4." in text


def test_a_palu_long_run_row_shows_its_paired_intervals_against_the_baseline_and_q4():
    q4 = {"ppl": 12.0, "kl": 0.1, "top1": 0.85, "bytes_x_raw": 0.3, "ppl_delta_ci95": [0.5, 0.9]}
    tier = {
        "ppl": 11.6,
        "kl": 0.05,
        "top1": 0.9,
        "bytes_x_raw": 0.15,
        "ppl_delta_ci95": [0.2, 0.4],
        "vs_q4": {
            "kl_delta": -0.05,
            "kl_delta_ci95": [-0.06, -0.04],
            "ppl_delta": -0.4,
            "ppl_delta_ci95": [-0.5, -0.3],
        },
    }
    result = {
        "date": "2026-12-02T00:00:00+00:00",
        "setup": _SETUP,
        "rows": {"baseline": _BASELINE, "mlx-lm-q4": q4, "palu-x": tier},
    }
    row = next(line for line in _palu(result) if line.startswith("| `palu-x`"))
    assert "| 0.150 | 0.50 | 0.05 | 0.50 | -5.00e-02 [-6.00e-02, -4.00e-02] | 90.0% | 11.60 |" in row
    assert row.endswith("| +0.310 [+0.200, +0.400] | -0.400 [-0.500, -0.300] |")
