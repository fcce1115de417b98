"""The main job (README's first command, ``hatch run demo``): both comparisons on the embedded model.

    python benchmarks/tools/main_job.py            # palu-mlx compare, flashcodec compare, then the docs
    python benchmarks/tools/main_job.py --quick    # a smoke run (few tokens) into a temp folder

Runs ``python -m palu_mlx.compare`` and ``python -m flashcodec.compare`` one after the other, each
in its own process (so one framework's memory does not sit under the other's peak-memory figure),
with the sizes below, writing ``benchmarks/results/compare_palu.{json,png}`` and
``compare_flashcodec.{json,png}``; then regenerates docs/benchmarks.md (and README.md's results
block) with ``benchmarks/tools/make_docs.py`` and prints where everything is. Nothing is downloaded.
Both run kvbench's protocol in bfloat16 at short context (16 windows of 192 + 128 tokens: 2,048
scored positions) and at long context (2 windows of 2,048 tokens, the last 256 scored) by default
(:data:`SIZES`); the main job runs 8 short windows and 1 long one (:data:`RUN_SIZES`), and palu with
its calibration file (the ``+cal`` tiers).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

#: kvbench's defaults, spelled out so the command says them
SIZES = {
    "--windows": "16",
    "--context-tokens": "192",
    "--scored-tokens": "128",
    "--new-tokens": "32",
    "--prompt-count": "2",
    "--long-context": "2048",
    "--long-windows": "2",
    "--long-scored-tokens": "256",
    "--speed-rounds": "3",
    "--speed-steps": "16",
}
#: ``--quick``: enough to see every column filled, in about a minute per comparison
QUICK = {
    "--windows": "2",
    "--context-tokens": "64",
    "--scored-tokens": "8",
    "--new-tokens": "4",
    "--prompt-count": "1",
    "--long-context": "320",
    "--long-windows": "1",
    "--long-scored-tokens": "16",
    "--speed-rounds": "1",
    "--speed-steps": "4",
}

#: what both comparisons run: fewer windows than SIZES, because with every tier, peer and calibrated
#: variant SIZES take over 40 minutes per comparison on a 2-core CPU (palu's decode steps attend over
#: codes in Python-driven chunks, mlx-lm's quantized peers prefill slowly, flashcodec has 16 caches)
RUN_SIZES = {**SIZES, "--windows": "8", "--long-windows": "1", "--speed-rounds": "2"}

#: the embedded model's palu calibration (``palu-mlx calibrate --model benchmarks/model/tiny-qwen3
#: --out benchmarks/model/tiny-qwen3.palu-calibration.safetensors``): adds the ``+cal`` tiers
PALU_CALIBRATION = ROOT / "benchmarks" / "model" / "tiny-qwen3.palu-calibration.safetensors"

#: (name, module, result stem, sizes, extra arguments)
JOBS = (
    ("palu-mlx", "palu_mlx.compare", "compare_palu", RUN_SIZES, ["--calibration", str(PALU_CALIBRATION)]),
    ("flashcodec", "flashcodec.compare", "compare_flashcodec", RUN_SIZES, []),
)


def run_job(module: str, stem: str, out_dir: Path, sizes: dict[str, str], extra: list[str]) -> int:
    """Run one compare module in a child process; its table and progress go to this terminal."""
    cmd = [
        sys.executable,
        "-m",
        module,
        "--json",
        str(out_dir / f"{stem}.json"),
        "--plot",
        str(out_dir / f"{stem}.png"),
    ]
    for option, value in sizes.items():
        cmd += [option, value]
    return subprocess.call(cmd + extra, cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run both comparisons on the embedded model and regenerate the docs."
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, results in a temporary folder, docs untouched"
    )
    parser.add_argument("--only", choices=[job[0] for job in JOBS], help="run one comparison only")
    args, extra = parser.parse_known_args(argv)
    out_dir = Path(tempfile.mkdtemp(prefix="kv-main-job-")) if args.quick else RESULTS
    started = time.perf_counter()
    written: list[Path] = []
    for name, module, stem, sizes, job_extra in JOBS:
        if args.only and name != args.only:
            continue
        print(f"\n=== {name}: python -m {module} ===", flush=True)
        code = run_job(module, stem, out_dir, QUICK if args.quick else sizes, job_extra + extra)
        if code != 0:
            print(f"main job: {module} failed with exit code {code}", file=sys.stderr)
            return code
        written += [out_dir / f"{stem}.json", out_dir / f"{stem}.png"]
    if not args.quick:
        from make_docs import main as make_docs

        make_docs([])
        written += [ROOT / "docs" / "benchmarks.md"]
    elapsed = time.perf_counter() - started
    print(f"\nmain job done in {elapsed:.0f} s. Results:")
    for path in written:
        print(f"  {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if not args.quick:
        print("Read docs/benchmarks.md for the tables, the charts and what they mean.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
