"""The flashcodec tiers that target the real model, beside transformers' hqq caches, in one run.

Runs ``flashcodec compare`` (kvbench's protocol) on the real model (SmolLM2-135M-Instruct, bf16,
each tier with its own attention: these on the codes) with :func:`compare_cli`'s arguments, keeps its whole
result and adds a summary per row of the long run (a window of 1,792 prefilled + 256 scored tokens, decode
timed at 2,048 tokens): bytes against the uncompressed bf16 cache, resident and averaged over
decoding (``resident_ratio_decode_mean``), KL to the baseline's next-token distribution, top-1
agreement, and decode tokens/s as a ratio to ``hf-hqq-q4`` in the same run.

    OMP_NUM_THREADS=1 hatch run bench:python benchmarks/flashcodec/real_tiers.py
    # writes benchmarks/results/flashcodec_real_tiers.json; --tiers to run other tiers,
    # --long-windows 2 for twice the scored positions, --out for another file

The figures it adds per row (against hqq 4-bit, in the same run):
``kl_vs_hqq_q4`` and ``bytes_vs_hqq_q4`` per row, ``decode_vs_hqq_q4`` for speed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from common import compare_result, long_run_args, tier_list
from kvbench.results import results_path, write_json

#: the tiers measured by default: the new split codecs, and the per-channel tier they replace
TIERS = "kivi64-k4v4-w64i8,kivi64-k8v8-w64i8,chan64-int4-w64i8"

#: the peers every row is read against
PEERS = "hf-hqq-q4,hf-hqq-q8"

KEPT = (
    "kv_ratio",
    "resident_ratio_decode_mean",
    "kl_mean",
    "kl_p99",
    "top1_agreement",
    "ppl_delta",
    "decode_tokens_per_s",
)


def summarize(result: dict, run_name: str = "long") -> list[dict]:
    """One row per candidate of ``run_name``: :data:`KEPT` plus ratios to ``hf-hqq-q4``."""
    run = next(r for r in result["runs"] if r["name"] == run_name)
    rows = {row["name"]: row for row in run["rows"]}
    peer = rows.get("hf-hqq-q4")
    out = []
    for name, row in rows.items():
        item = {"name": name, **{k: row.get(k) for k in KEPT}}
        if peer is not None:
            item["bytes_vs_hqq_q4"] = row["resident_ratio_decode_mean"] / peer["resident_ratio_decode_mean"]
            item["kl_vs_hqq_q4"] = row["kl_mean"] / peer["kl_mean"] if peer["kl_mean"] else None
            item["decode_vs_hqq_q4"] = row["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
        out.append(item)
    return out


def compare_cli(tiers: Sequence[str], model: str | None = None, long_windows: int = 1) -> list[str]:
    """``flashcodec compare``'s arguments for ``tiers``: :func:`common.long_run_args` with
    ``long_windows`` windows in the long run and no memory curve, led by ``--model`` when one is
    given (else compare's default model)."""
    cli = ["--tiers", ",".join(tiers), *long_run_args(PEERS, long_windows=long_windows), "--no-memory-curve"]
    return ["--model", model, *cli] if model else cli


def write_summary(result: dict, out: Path, width: int = 26, speed: bool = False) -> None:
    """Add ``summary_long`` (:func:`summarize`) to ``result``, write it to ``out`` and print a line a
    row: the name padded to ``width``, bytes, KL, top-1 and their ratios to hqq-q4 (with ``speed``,
    the decode speed's ratio too)."""
    result["summary_long"] = summarize(result)
    write_json(out, result)
    for row in result["summary_long"]:
        line = (
            f"{row['name']:{width}s} bytes {row['resident_ratio_decode_mean']:.3f}  KL {row['kl_mean']:.2e}  "
            f"top-1 {row['top1_agreement']:.3f}  bytes x hqq-q4 {row.get('bytes_vs_hqq_q4') or 0:.3f}  "
            f"KL x hqq-q4 {row.get('kl_vs_hqq_q4') or 0:.3f}"
        )
        print(line + (f"  decode x hqq-q4 {row.get('decode_vs_hqq_q4') or 0:.2f}" if speed else ""))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", type=tier_list, default=tier_list(TIERS))
    parser.add_argument(
        "--model", default=None, help="kvbench model name or directory (default: the real model)"
    )
    parser.add_argument(
        "--long-windows", type=int, default=1, help="windows of the long run (2: twice the positions)"
    )
    parser.add_argument("--compare-json", type=Path, help="summarize this compare JSON instead of running")
    parser.add_argument("--out", type=Path, default=results_path("flashcodec_real_tiers.json"))
    args = parser.parse_args(argv)
    cli = compare_cli(args.tiers, args.model, args.long_windows)
    result = compare_result(cli, args.compare_json)
    result["command"] = "python -m flashcodec.compare " + " ".join(cli)
    write_summary(result, args.out, speed=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
