"""Which transformers families the zero-argument default compresses, from the tests themselves.

Runs ``packages/flashcodec-torch/tests/test_families_hf.py`` (tiny random-weight models of each
family, bf16, a 400-token prompt and 16 greedy tokens, ``apply_flash_codec(model)`` with nothing
else) with ``FLASHCODEC_FAMILIES_RECORD`` set, so every family's measurement is the one the test
asserted on: the bytes reachable from the cache over ``DynamicCache``'s, and whether the tokens
equal the materialized path's. Writes ``benchmarks/results/flashcodec_families.json``; make_docs.py
renders its table into docs/flashcodec.md.

    hatch run torch:python benchmarks/flashcodec/families.py
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
TEST = ROOT / "packages" / "flashcodec-torch" / "tests" / "test_families_hf.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=results_path("flashcodec_families.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        record = Path(scratch) / "families.jsonl"
        env = dict(os.environ, FLASHCODEC_FAMILIES_RECORD=str(record))
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TEST)], env=env, cwd=ROOT
        )
        rows = [json.loads(line) for line in record.read_text(encoding="utf-8").splitlines()]
    if not rows:
        print("no family was measured", file=sys.stderr)
        return 1
    result = {
        **environment_stamp(["torch", "transformers", "flashcodec-kv"]),
        "tool": "benchmarks/flashcodec/families.py",
        "setup": (
            "tiny random-weight models (6 layers, hidden 256, 4 query heads, 2 KV heads of 64, a "
            "sliding window of 128 where the family has one), bf16; a 400-token prompt and 16 greedy "
            "tokens; apply_flash_codec(model) with no argument; ratio = bytes of every tensor storage "
            "reachable from the cache (flashcodec.hf.resident_bytes) over DynamicCache's on the same run; "
            "tokens compared in float32 with the materialized path of the same codec"
        ),
        "tests_passed": run.returncode == 0,
        "families": rows,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
