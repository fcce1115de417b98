"""The window tiers beside transformers' hqq 4-bit cache over 16 long windows (issue 14's target).

The main job's compare scores one long window (1,792 tokens of context, 256 scored), which is
one draw: KL and Δ perplexity between caches this close move by tens of per cent from window to
window. This runs the same ``flashcodec compare`` (the kvbench protocol, real caches, bf16, the
embedded model) on the tiers that aim at the target and the peer only, over 16 long windows, and
keeps its whole JSON. Bytes (held, resident, and both averaged over the first window's decode
positions) are measured from the tensors each cache holds; KL, top-1 and Δ perplexity are over
all 16 x 256 scored positions.

    hatch run bench:python benchmarks/flashcodec/window_compare.py   # results/flashcodec_window_compare.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import RESULTS

TIERS = "jpeg-k8-int4z-mf,jpeg-k8-int4z-w64-mf,jpeg-k8-int4z-w96i8-mf"

#: a short run is part of every compare: kept minimal here, the long run is the point
COMPARE_ARGS = [
    "--tiers", TIERS, "--peers", "hf-hqq-q4",
    "--windows", "2", "--context-tokens", "192", "--scored-tokens", "64", "--new-tokens", "8",
    "--prompt-count", "1",
    "--long-context", "2048", "--long-windows", "16", "--long-scored-tokens", "256",
    "--speed-rounds", "2", "--speed-steps", "16", "--quiet",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "flashcodec_window_compare.json")
    args = parser.parse_args(argv)
    from flashcodec.compare import main as compare

    return compare([*COMPARE_ARGS, "--json", str(args.out)])


if __name__ == "__main__":
    sys.exit(main())
