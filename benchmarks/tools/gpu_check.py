"""One-shot GPU check of materialization-free decode: kernel correctness on CUDA, then speed and memory.

Run it once on a machine with a CUDA GPU, in an environment with CUDA torch, triton and
transformers and the repository's packages installed (``pip install -e packages/kvspec
packages/flashcodec-torch``)::

    python benchmarks/tools/gpu_check.py            # a few minutes on one GPU

It writes, under ``benchmarks/results/``:

* ``flashcodec_gpu_check.json``: the CUDA test outcomes of ``test_kernel_triton.py`` and
  ``test_attention.py`` (the Triton kernel against its torch reference and the materialized path),
  stamped with the device;
* ``flashcodec_attention_cuda.json``: ``benchmarks/flashcodec/attention.py --device cuda --dim 128`` (materialized,
  coefficient torch and coefficient Triton per sequence length, CUDA timings and
  ``torch.cuda.max_memory_allocated``);
* ``flashcodec_e2e_cuda.json``: ``benchmarks/flashcodec/e2e.py --device cuda`` on the embedded model.

Nothing here runs without CUDA: it exits with a message instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
TESTS = ROOT / "packages" / "flashcodec-torch" / "tests"


def run_tests() -> dict:
    """Run the kernel and attention tests on CUDA; return the counts and every case that did not pass."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
        cmd += [
            str(TESTS / "test_kernel_triton.py"),
            str(TESTS / "test_attention.py"),
            f"--junitxml={report}",
        ]
        proc = subprocess.run(cmd, cwd=TESTS, capture_output=True, text=True, env=dict(os.environ))
        print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n")
        counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
        not_passed = []
        cases = list(ET.parse(report).getroot().iter("testcase")) if report.exists() else []
        for case in cases:
            outcome = "passed"
            for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
                node = case.find(tag)
                if node is not None:
                    outcome = name
                    not_passed.append(
                        {"test": case.get("name"), "outcome": name, "message": node.get("message")}
                    )
                    break
            counts[outcome] += 1
    return {
        "command": " ".join(cmd[1:-1]),
        "returncode": proc.returncode,
        "counts": counts,
        "not_passed": not_passed,
    }


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA device; none is visible here (nothing was run)")
    sys.path.insert(0, str(BENCH / "flashcodec"))
    # run directly on a GPU machine (no hatch): this repository's folders, as hatch.toml sets them
    os.environ.setdefault("KVBENCH_RESULTS", str(BENCH / "results"))
    os.environ.setdefault("KVBENCH_EMBEDDED_MODEL", str(BENCH / "model" / "tiny-qwen3"))
    from kvbench.results import environment_stamp, results_path, write_json

    tests = run_tests()
    stamp = environment_stamp(["torch", "triton", "transformers", "flashcodec-kv", "kvcache-spec"])
    stamp["machine"]["device"] = torch.cuda.get_device_name(0)
    write_json(results_path("flashcodec_gpu_check.json"), {"benchmark": "gpu_check", **stamp, "tests": tests})

    import attention
    import e2e

    attention.main(["--device", "cuda", "--dim", "128", "--seqs", "4096,16384,65536", "--threads", "4"])
    e2e.main(["--device", "cuda", "--threads", "4"])
    if tests["returncode"] != 0:
        sys.exit(f"CUDA tests did not all pass: {tests['counts']}")


if __name__ == "__main__":
    main()
