"""Which mlx-lm families palu's zero-argument default compresses, from the test itself.

Runs ``packages/palu-mlx/tests/test_default_bytes_families.py`` (tiny random-weight models of each
family, a 400-token prompt and 16 greedy tokens, ``KVCacheBuilder.for_model(model, KVCacheConfig())``)
with ``PALU_FAMILIES_RECORD`` set, so every family's figure is the one the test asserted on: the
bytes of every array reachable from the caches over mlx-lm's own caches', and how its layers are
held. Writes ``benchmarks/results/palu_families.json``; make_docs.py renders its table into
docs/palu-mlx.md.

    hatch run mlx:python benchmarks/palu/families.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvbench.results import environment_stamp, results_path, write_json

ROOT = Path(__file__).resolve().parents[2]
TEST = ROOT / "packages" / "palu-mlx" / "tests" / "test_default_bytes_families.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=results_path("palu_families.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        record = Path(scratch) / "families.jsonl"
        env = dict(os.environ, PALU_FAMILIES_RECORD=str(record))
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TEST)], env=env, cwd=ROOT
        )
        rows = [json.loads(line) for line in record.read_text(encoding="utf-8").splitlines()]
    if not rows:
        print("no family was measured", file=sys.stderr)
        return 1
    result = {
        **environment_stamp(["mlx", "mlx-lm", "palu-mlx"]),
        "tool": "benchmarks/palu/families.py",
        "setup": (
            "tiny random-weight models (6 layers, hidden 256, 4 query heads, 2 KV heads of 64, a sliding "
            "window of 128 where mlx-lm gives the family rotating caches), bf16 (the MoE families float32: "
            "MLX's CPU gather matmul has no bf16); a 400-token prompt and 16 greedy tokens; "
            "KVCacheBuilder.for_model(model, KVCacheConfig()); ratio = bytes of every array reachable "
            "from the caches, each once, over mlx-lm's make_prompt_cache(model)'s on the same run"
        ),
        "tests_passed": run.returncode == 0,
        "families": rows,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
