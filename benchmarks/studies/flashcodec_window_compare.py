"""The int4 tiers with a window beside transformers' hqq 4-bit cache over every long window the
held-out text holds: does an int4 tier with a window beat hqq 4-bit at its bytes?

The main job's compare scores one long window (1,792 tokens of context, 256 scored), which is
one draw: KL and Δ perplexity between caches this close move by tens of per cent from window to
window, and a Δ perplexity gap of a few hundredths needs thousands of positions to show at all.
This runs the same ``flashcodec compare`` (the kvbench protocol, real caches, bf16, the
embedded model) on the tiers that aim at the target and the peer only, over 18 windows of 2,048
tokens (all the text holds), each scoring its last 512 positions (1,536 to 2,047 tokens of
context): 9,216 positions. It keeps the whole JSON, whose ``ppl_vs_peers`` field pairs each
tier's perplexity with hqq's on the same positions (bootstrap interval). Bytes (held, resident,
and both averaged over the first window's decode positions) are measured from the tensors each
cache holds.

    hatch run bench:python benchmarks/studies/flashcodec_window_compare.py   # results/flashcodec_window_compare.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvbench.results import results_path

TIERS = "jpeg-k8-int4z-w96i8,chan64-int4-w64i8"

#: a short run is part of every compare: kept minimal here, the long run is the point
COMPARE_ARGS = [
    "--tiers", TIERS, "--peers", "hf-hqq-q4",
    "--windows", "2", "--context-tokens", "192", "--scored-tokens", "64", "--new-tokens", "8",
    "--prompt-count", "1",
    "--long-context", "2048", "--long-windows", "18", "--long-scored-tokens", "512",
    "--speed-rounds", "2", "--speed-steps", "16", "--quiet",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=results_path("flashcodec_window_compare.json"))
    args = parser.parse_args(argv)
    from flashcodec.compare import main as compare

    return compare([*COMPARE_ARGS, "--json", str(args.out)])


if __name__ == "__main__":
    sys.exit(main())
