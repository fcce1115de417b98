"""Which model families a package's zero-argument default compresses, from the package's own test.

Runs the package's family byte test (tiny random-weight models of each family, a 400-token prompt
and 16 greedy tokens, the default with no argument) with the test's record variable set, so every
family's figure is the one the test asserted on. Writes ``benchmarks/results/<package>_families.json``;
make_docs.py renders its table into the package's docs page.

    hatch run torch:python benchmarks/tools/families.py flashcodec
    hatch run mlx:python benchmarks/tools/families.py palu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from kvbench.results import environment_stamp, results_path, write_json

ROOT = Path(__file__).resolve().parents[2]


class FamilyTest(NamedTuple):
    test: Path
    record_variable: str
    packages: list[str]
    setup: str


TESTS = {
    "flashcodec": FamilyTest(
        ROOT / "packages" / "flashcodec-torch" / "tests" / "test_families_hf.py",
        "FLASHCODEC_FAMILIES_RECORD",
        ["torch", "transformers", "flashcodec-kv"],
        "tiny random-weight models (6 layers, hidden 256, 4 query heads, 2 KV heads of 64, a sliding window "
        "of 128 where the family has one), bf16; a 400-token prompt and 16 greedy tokens; "
        "apply_flash_codec(model) with no argument; ratio = bytes of every tensor storage reachable from the "
        "cache (flashcodec.hf.resident_bytes) over DynamicCache's on the same run; tokens compared in float32 "
        "with the materialized path of the same codec",
    ),
    "palu": FamilyTest(
        ROOT / "packages" / "palu-mlx" / "tests" / "test_default_bytes_families.py",
        "PALU_FAMILIES_RECORD",
        ["mlx", "mlx-lm", "palu-mlx"],
        "tiny random-weight models (6 layers, hidden 256, 4 query heads, 2 KV heads of 64, a sliding window of "
        "128 where mlx-lm gives the family rotating caches), bf16 (the MoE families float32: MLX's CPU gather "
        "matmul has no bf16); a 400-token prompt and 16 greedy tokens; KVCacheBuilder.for_model(model, "
        "KVCacheConfig()); ratio = bytes of every array reachable from the caches, each once, over mlx-lm's "
        "make_prompt_cache(model)'s on the same run",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", choices=sorted(TESTS))
    parser.add_argument("--out", type=Path, default=None, help="default: results/<package>_families.json")
    args = parser.parse_args(argv)
    family_test = TESTS[args.package]
    out = args.out or results_path(f"{args.package}_families.json")
    with tempfile.TemporaryDirectory() as scratch:
        record = Path(scratch) / "families.jsonl"
        env = dict(os.environ, **{family_test.record_variable: str(record)})
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(family_test.test)]
        run = subprocess.run(command, env=env, cwd=ROOT)
        lines = record.read_text(encoding="utf-8").splitlines() if record.is_file() else []
    rows = [json.loads(line) for line in lines]
    if not rows:
        print("no family was measured", file=sys.stderr)
        return 1
    result = {
        **environment_stamp(family_test.packages),
        "tool": f"benchmarks/tools/families.py {args.package}",
        "setup": family_test.setup,
        "tests_passed": run.returncode == 0,
        "families": rows,
    }
    write_json(out, result)
    print(f"wrote {out}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
