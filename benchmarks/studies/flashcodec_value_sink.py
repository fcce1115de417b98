"""A value sink on the real model: the first token's value kept in int8 beside its exact key.

The rotated KIVI tiers keep the first key of the sequence exact (block 0's zero points) but code
its value like every other token's, in 2-4 bits. In the fake-quantization study
(``lowbit_study.py``) the first token's key and value in int8 lowered the KL more than any other
factor. ``RotatedKIVICodec(..., value_sink_tokens=1)`` keeps that value apart in the int8 window's
form once block 0 is archived (a stream's sink: ``flashcodec.stream``), and attention on the codes
reads it there. This script measures each candidate beside its tier without the sink, in one
``flashcodec compare`` run (``real_tiers.py``'s protocol and settings: SmolLM2-135M-Instruct,
bf16, windows of 1,792 prefilled + 256 scored tokens decoded one at a time, attention on the
codes, hqq 4/8-bit in the same run). The candidates are study configurations
(``benchmarks/studies/flashcodec_tiers.py``); neither beat its tier enough to join the registry.

    OMP_NUM_THREADS=1 nice -n 10 hatch run bench:python benchmarks/studies/flashcodec_value_sink.py --long-windows 2
    # writes benchmarks/results/flashcodec_value_sink_2w.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashcodec"))  # common.py
from common import compare_result, study_tier
from kvbench.results import results_path
from real_tiers import compare_cli, write_summary

#: candidate -> the tier it adds a one-token value sink to
CANDIDATES = {
    "kivi64r-k4v4-w64i8-s8-vs1": "kivi64r-k4v4-w64i8-s8",
    "kivi64r-k3v2-w0i8-s8z4-vs1": "kivi64r-k3v2-w0i8-s8z4",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="kvbench model name or directory (default: the real model)"
    )
    parser.add_argument("--long-windows", type=int, default=2, help="windows of the long run")
    parser.add_argument("--compare-json", type=Path, help="summarize this compare JSON instead of running")
    parser.add_argument("--out", type=Path, default=None, help="default: flashcodec_value_sink_<n>w.json")
    args = parser.parse_args(argv)
    out = args.out or results_path(f"flashcodec_value_sink_{args.long_windows}w.json")
    descriptions = {}
    names = []
    for candidate, base in CANDIDATES.items():
        for name in (base, candidate):  # each with its own attention: on the codes
            descriptions[name] = study_tier(name).description
            names.append(name)
    cli = compare_cli(names, args.model, args.long_windows)
    t0 = time.perf_counter()
    result = compare_result(cli, args.compare_json)
    result["command"] = "python benchmarks/studies/flashcodec_value_sink.py " + " ".join(
        [f"--long-windows {args.long_windows}", *([f"--model {args.model}"] if args.model else [])]
    )
    result["compare_args"] = cli
    result["candidates"] = descriptions
    result["wall_s"] = time.perf_counter() - t0
    write_summary(result, out, width=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
