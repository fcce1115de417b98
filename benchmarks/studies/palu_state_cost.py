"""What reading palu-mlx caches' ``state`` costs during a long prefill on the real model.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
      hatch run mlx:python benchmarks/studies/palu_state_cost.py

Writes ``benchmarks/results/palu_state_cost.json``. mlx-lm's ``generate_step`` evaluates
``[c.state for c in prompt_cache]`` after every prefill chunk (2,048 tokens by default), and a
palu cache's ``state`` carries a sha256 checksum of all its arrays (``palu_mlx.integrity``), so each
read hashes the whole cache. This script:

* prefills ``--tokens`` tokens of kvbench's held-out text on SmolLM2-135M-Instruct with mlx-lm's
  ``KVCache`` (float32 compute, keys and values rounded to bfloat16: what a bfloat16 model caches);
* hands those keys and values to palu caches (``KVCacheBuilder.for_model``, palu's default config
  as ``palu-mlx server`` / ``generate`` build it) in ``--chunk``-token chunks, as the prefill does;
* after each chunk times, best of ``--repeats``: ``state`` of every layer, evaluated (what mlx-lm
  does), and ``palu_mlx.integrity.digest`` alone over the same arrays (the checksum's share),
  beside the bytes the state holds and an mlx-lm ``KVCache``'s ``state`` at the same tokens.

Times are wall-clock on whatever machine runs it (here a shared 2-core CPU): read the checksum's
share of ``state`` and the bytes hashed, not the absolute seconds, as the portable figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from argparse import Namespace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlx.core as mx
from kvbench.models import default_text_path
from mlx_lm.models.cache import KVCache
from palu_mlx import KVCacheBuilder
from palu_mlx.compare import load_model
from palu_mlx.integrity import digest
from palu_mlx.serving import describe, palu_config

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "palu_state_cost.json"
META = "meta_state"  # the array palu adds to state (palu_mlx.state_checks.STATE_META)


def best_of(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (mlx-lm's default 2,048)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)

    model, tokenizer, info = load_model(args.model, "bfloat16", compute_dtype="float32")
    ids = tokenizer.encode(default_text_path().read_text(encoding="utf-8"))
    if len(ids) < args.tokens:
        raise SystemExit(f"the held-out text has {len(ids)} tokens; --tokens {args.tokens} needs more")
    tokens = mx.array(ids[: args.tokens])[None]
    plain = [KVCache() for _ in model.layers]
    for start in range(0, args.tokens, 512):
        mx.eval(model(tokens[:, start : start + 512], cache=plain))
    kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in plain]
    mx.eval(kv)

    config = palu_config(model, Namespace())
    caches = KVCacheBuilder.for_model(model, config)
    rows = []
    for start in range(0, args.tokens, args.chunk):
        stop = min(start + args.chunk, args.tokens)
        for cache, (k, v) in zip(caches, kv, strict=True):
            cache.update_and_fetch(k[..., start:stop, :], v[..., start:stop, :])
            mx.eval(cache.held_arrays())
        states = [c.state for c in caches]
        mx.eval(states)
        arrays = [{n: a for n, a in s.items() if n != META} for s in states]
        metas = [c.meta_state for c in caches]
        state_bytes = sum(a.nbytes for s in arrays for a in s.values())
        state_s = best_of(lambda: mx.eval([c.state for c in caches]), args.repeats)
        digest_s = best_of(
            lambda arrays=arrays, metas=metas: [
                digest(a, {"settings": m[0], "runtime": m[1]}) for a, m in zip(arrays, metas, strict=True)
            ],
            args.repeats,
        )
        plain_cut = [KVCache() for _ in model.layers]
        for c, (k, v) in zip(plain_cut, kv, strict=True):
            c.update_and_fetch(k[..., :stop, :], v[..., :stop, :])
        mx.eval([c.state for c in plain_cut])
        plain_s = best_of(lambda plain_cut=plain_cut: mx.eval([c.state for c in plain_cut]), args.repeats)
        row = {
            "tokens": stop,
            "palu_state_bytes": state_bytes,
            "palu_state_s": state_s,
            "digest_s": digest_s,
            "digest_share_of_state": digest_s / state_s if state_s else None,
            "sha256_mb_per_s": state_bytes / digest_s / 1e6 if digest_s else None,
            "mlx_lm_kvcache_state_bytes": sum(
                a.nbytes for c in plain_cut for a in c.state if isinstance(a, mx.array)
            ),
            "mlx_lm_kvcache_state_s": plain_s,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    doc = {
        "script": "benchmarks/studies/palu_state_cost.py",
        "command": "python benchmarks/studies/palu_state_cost.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "written": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": info,
        "palu_config": describe(config),
        "layers": len(caches),
        "settings": {"tokens": args.tokens, "chunk": args.chunk, "repeats": args.repeats},
        "prefill_state_total_s": sum(r["palu_state_s"] for r in rows),
        "prefill_digest_total_s": sum(r["digest_s"] for r in rows),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
