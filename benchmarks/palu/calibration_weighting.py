"""Does weighting the calibration by attention help? ``--weighting none`` against ``attention``.

    hatch run bench:python benchmarks/palu/calibration_weighting.py                  # the embedded model
    hatch run bench:python benchmarks/palu/calibration_weighting.py --max-tokens 4096 --windows 2

Calibrates the model twice on the same calibration text and tokens (``palu-mlx calibrate``
with ``--weighting none`` and ``--weighting attention``, into a temporary directory), runs
``palu-mlx compare --calibration FILE`` once per file with the same settings (through
``benchmarks/studies/palu_tiers.py``, which offers the study configurations too), and writes
``benchmarks/results/palu_calibration_weighting.json``: the settings, each run's rows (the
``<tier>+cal`` candidates, the uncalibrated tiers and the peers, short and long context) and
a table of the ``+cal`` rows side by side. Both compare runs score the same held-out windows
against the same uncompressed baseline, so the ``+cal`` rows differ only by the file's
weighting; the uncalibrated rows of the two runs are the same candidates measured twice and show
the run-to-run noise of what is measured identically (quality is deterministic; speed is not).

Both files use ``--max-tokens`` calibration tokens (default 8,192, to keep the run affordable
on a CPU; the embedded model's shipped file uses all of the shipped text), so compare the two
runs with each other, not with ``compare_palu.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbench.models import embedded_model_path
from kvbench.results import environment_stamp, results_path, write_json

WEIGHTINGS = ("none", "attention")
#: ``palu-mlx compare`` offering the study configurations too (the default tiers are studies)
STUDY_COMPARE = Path(__file__).resolve().parents[1] / "studies" / "palu_tiers.py"
#: what the side-by-side table keeps of a row
FIELDS = ("kv_bytes", "bits_per_element", "kl_mean", "kl_p99", "top1_agreement", "ppl_delta")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    p.add_argument("--max-tokens", type=int, default=8192, help="calibration tokens per file (default 8192)")
    p.add_argument("--window", type=int, default=512, help="calibration window (default 512)")
    p.add_argument("--tiers", default="palu-2bit,palu-1.5bit,palu-1bit")
    p.add_argument("--peers", default="mlx-lm-q4")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--context-tokens", type=int, default=192)
    p.add_argument("--scored-tokens", type=int, default=96)
    p.add_argument("--long-context", type=int, default=2048)
    p.add_argument("--long-windows", type=int, default=1)
    p.add_argument("--long-scored-tokens", type=int, default=128)
    p.add_argument("--prompt-count", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--speed-rounds", type=int, default=1)
    p.add_argument("--speed-steps", type=int, default=4)
    p.add_argument("--keep", default=None, help="directory to keep the two calibration files in")
    p.add_argument("--out", default=str(results_path("palu_calibration_weighting.json")))
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error(f"--max-tokens {args.max_tokens} must be at least 2")
    return args


def run(cmd: list[str]) -> float:
    """Run ``cmd`` (its output passes through); seconds taken. Exits with its code if it fails."""
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, check=False)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}")
    return time.perf_counter() - start


def git_commit() -> str | None:
    """The repository's HEAD, so a result names the code it measured (None outside a checkout)."""
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def calibrate_cmd(args: argparse.Namespace, model: str, weighting: str, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "palu_mlx.cli", "calibrate", "--model", model, "--out", str(out),
        "--max-tokens", str(args.max_tokens), "--window", str(args.window),
        "--weighting", weighting, "--quiet",
    ]  # fmt: skip


def compare_cmd(args: argparse.Namespace, model: str, calibration: Path, out: Path) -> list[str]:
    return [
        sys.executable, str(STUDY_COMPARE), "--model", model, "--tiers", args.tiers,
        "--peers", args.peers, "--calibration", str(calibration), "--windows", str(args.windows),
        "--context-tokens", str(args.context_tokens), "--scored-tokens", str(args.scored_tokens),
        "--long-context", str(args.long_context), "--long-windows", str(args.long_windows),
        "--long-scored-tokens", str(args.long_scored_tokens), "--speed-rounds", str(args.speed_rounds),
        "--speed-steps", str(args.speed_steps), "--prompt-count", str(args.prompt_count),
        "--new-tokens", str(args.new_tokens), "--json", str(out), "--quiet",
    ]  # fmt: skip


def side_by_side(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per run (short / long) and ``+cal`` tier: each weighting's fields and attention - none."""
    table = []
    runs = {w: {r["name"]: r for r in results[w]["compare"]["runs"]} for w in WEIGHTINGS}
    for run_name, run_none in runs["none"].items():
        run_attention = runs["attention"][run_name]
        rows_none = {r["name"]: r for r in run_none["rows"]}
        rows_attention = {r["name"]: r for r in run_attention["rows"]}
        for name, row in rows_none.items():
            if not name.endswith("+cal") or name not in rows_attention:
                continue
            entry = {"run": run_name, "candidate": name}
            for w, r in (("none", row), ("attention", rows_attention[name])):
                entry[w] = {f: r.get(f) for f in FIELDS}
            entry["attention_minus_none"] = {
                f: entry["attention"][f] - entry["none"][f]
                for f in FIELDS
                if isinstance(entry["attention"][f], (int, float))
                and isinstance(entry["none"][f], (int, float))
            }
            table.append(entry)
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or str(embedded_model_path())
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.keep) if args.keep else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        for weighting in WEIGHTINGS:
            calibration = where / f"calibration-{weighting}.safetensors"
            cal_cmd = calibrate_cmd(args, model, weighting, calibration)
            cal_seconds = run(cal_cmd)
            compare_json = Path(tmp) / f"compare-{weighting}.json"
            cmp_cmd = compare_cmd(args, model, calibration, compare_json)
            cmp_seconds = run(cmp_cmd)
            from palu_mlx.calibration import Calibration

            header = Calibration.load(calibration)
            results[weighting] = {
                "calibrate_command": cal_cmd[2:],
                "calibrate_seconds": cal_seconds,
                "calibration": {
                    "weighting": header.weighting,
                    "tokens": header.tokens,
                    "pre_rope": header.pre_rope,
                    "text_sha256": header.text_sha256,
                },
                "compare_command": cmp_cmd[2:],
                "compare_seconds": cmp_seconds,
                "compare": json.loads(compare_json.read_text(encoding="utf-8")),
            }
    out = {
        "schema": "palu-mlx.calibration-weighting.v1",
        "tool": "benchmarks/palu/calibration_weighting.py",
        "stamp": environment_stamp(["palu-mlx", "kvbench", "mlx", "mlx-lm"]) | {"git_commit": git_commit()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "keep")} | {"model": model},
        "note": (
            "both files calibrated on the same tokens; both compare runs score the same held-out windows "
            "against the same baseline. side_by_side: the +cal rows of each run, attention minus none."
        ),
        "side_by_side": side_by_side(results),
        "runs": results,
    }
    write_json(args.out, out)
    for entry in out["side_by_side"]:
        n, a = entry["none"], entry["attention"]
        print(
            f"{entry['run']:5} {entry['candidate']:14} bytes {n['kv_bytes']} / {a['kv_bytes']}  "
            f"KL {n['kl_mean']:.4f} / {a['kl_mean']:.4f}  top-1 {n['top1_agreement']:.3f} / "
            f"{a['top1_agreement']:.3f}  dppl {n['ppl_delta']:+.2f} / {a['ppl_delta']:+.2f}  (none / attention)"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
