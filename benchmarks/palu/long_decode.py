"""palu-mlx at long context: decode speed and decode-time peak memory beside mlx-lm's caches.

    hatch run bench:python benchmarks/palu/long_decode.py                 # contexts 2,048 and 8,192
    hatch run bench:python benchmarks/palu/long_decode.py --contexts 2048 --rounds 3
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        hatch run bench:python benchmarks/palu/long_decode.py --model smollm2-135m \
        --compute-dtype float32 --tiers palu-2.25bit-scaled+rel --rebuild-tier '' \
        --steps 2 --rounds 1 --out benchmarks/results/palu_long_decode_real.json   # the real model

Writes ``benchmarks/results/palu_long_decode.json`` (``--out``). For each context length, on the
embedded model (``--model``: a kvbench model name, a directory or a hub id) in bfloat16:

* the model prefills the context once with mlx-lm's ``KVCache`` (the held-out text, repeated
  past the model's 2,048 trained positions: memory and speed do not depend on what the tokens
  say, and quality is ``palu-mlx compare``'s job);
* every candidate cache is filled from those keys and values in 512-token chunks, as a chunked
  prefill hands them over (palu fits on the first chunk; mlx-lm's ``QuantizedKVCache`` is
  filled the same way);
* **speed**: candidates take turns, ``--steps`` decode steps each per round, ``--rounds`` rounds;
  each keeps its best round's tokens/s (the machine is shared and noisy; the ratios are what
  count);
* **memory**: per candidate, the bytes its arrays hold, and the peak of one decode step counted
  from before the cache existed (``mx.get_peak_memory`` minus the memory allocated before the
  cache was filled: cache, the step's transient arrays and activations).

``--compute-dtype float32`` (for a real model on Linux, where MLX's CPU wheel multiplies bfloat16
matrices without a BLAS): the prefills run in float32 with the keys and values rounded to
bfloat16 (``palu_mlx.compare.load_model``), then the model is cast to bfloat16 for the caches and
the decode steps, so the memory figures are a bfloat16 model's.

palu caches are built by ``KVCacheBuilder.for_model``, so their attention runs on the latent
codes (:mod:`palu_mlx.attention`). The ``-rebuild`` row runs one tier's caches through the older
path that rebuilds the whole history for SDPA, for comparison. ``+cal`` rows use the embedded
model's calibration file (``--calibration``): their per-model constants (bases, means, steps) are
not in the bytes held, as weights are not. ``+sens`` tiers read the model's sensitivity profile
(``--sensitivity``, written by ``palu-mlx sensitivity``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from kvbench.models import EMBEDDED_MODEL, default_text_path
from kvbench.results import environment_stamp, results_path, write_json
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from palu_mlx import KVCacheBuilder
from palu_mlx.attention import route_attention, unroute_attention
from palu_mlx.builder import model_kv_dims
from palu_mlx.compare import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from studies.palu_tiers import tier, tier_config  # noqa: E402  (registry and study tiers)

CHUNK = 512
PALU_TIERS = ("palu-2bit", "palu-1.5bit", "palu-1.25bit", "palu-1bit")
#: the tier also run through the path that rebuilds the whole history (for comparison)
REBUILD_TIER = "palu-1.5bit"
#: the embedded model's calibration file: adds ``<tier>+cal`` rows
CALIBRATION = Path(__file__).resolve().parents[1] / "model" / "tiny-qwen3.palu-calibration.safetensors"


def stamp() -> dict:
    return {
        **environment_stamp(["palu-mlx", "kvbench", "mlx", "mlx-lm"]),
        "command": " ".join(["python benchmarks/palu/long_decode.py", *sys.argv[1:]]),
    }


def context_kv(model: Any, tokens: mx.array) -> list[tuple[mx.array, mx.array]]:
    """Each layer's rotated keys and values after a chunked prefill of ``tokens [1, S]``."""
    cache = [KVCache() for _ in model.layers]
    for start in range(0, tokens.shape[1], CHUNK):
        mx.eval(model(tokens[:, start : start + CHUNK], cache=cache))
    kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]
    mx.eval(kv)
    return kv


def fill(caches: list[Any], kv: list[tuple[mx.array, mx.array]]) -> list[Any]:
    """Hand each layer's keys and values to its cache in prefill-sized chunks."""
    for cache, (keys, values) in zip(caches, kv, strict=True):
        for start in range(0, keys.shape[2], CHUNK):
            out = cache.update_and_fetch(
                keys[..., start : start + CHUNK, :], values[..., start : start + CHUNK, :]
            )
            # palu returns the rebuilt history lazily: evaluate what it holds, not that
            mx.eval(cache.held_arrays() if hasattr(cache, "held_arrays") else out)
    return caches


def candidates(
    model: Any,
    calibration: str | None,
    tiers: tuple[str, ...] = PALU_TIERS,
    sensitivity: str | None = None,
) -> dict[str, Callable[[], list[Any]]]:
    """Cache makers by name: the baseline, mlx-lm's 4-bit cache, ``tiers`` (a ``+sens`` tier reads
    the profile ``sensitivity``), and with ``calibration`` each tier's ``+cal`` twin."""
    head_dim, _ = model_kv_dims(model)
    out: dict[str, Callable[[], list[Any]]] = {
        "baseline": lambda: [KVCache() for _ in model.layers],
        "mlx-lm-q4": lambda: [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers],
    }
    for name in tiers:
        profile = sensitivity if tier(name).calibration == "sensitivity" else None
        config = tier_config(name, head_dim, profile)
        out[name] = lambda config=config: KVCacheBuilder.for_model(model, config)
        if calibration is not None:
            cal = config.replace(palu_calibration=calibration)
            out[f"{name}+cal"] = lambda cal=cal: KVCacheBuilder.for_model(model, cal)
    return out


def step(model: Any, cache: list[Any], token: mx.array, routed: bool) -> None:
    if routed:
        route_attention(model)
    else:
        unroute_attention(model)
    mx.eval(model(token, cache=cache))


def measure_context(
    model: Any,
    kv: list[tuple[mx.array, mx.array]],
    steps: int,
    rounds: int,
    calibration: str | None,
    tiers: tuple[str, ...] = PALU_TIERS,
    rebuild_tier: str | None = REBUILD_TIER,
    sensitivity: str | None = None,
) -> dict:
    names = candidates(model, calibration, tiers, sensitivity)
    runs = [(name, True) for name in names]
    if rebuild_tier:
        runs.append((f"{rebuild_tier}-rebuild", False))
    token = mx.array([[11]])
    rows: dict[str, dict] = {}
    for name, routed in runs:
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        cache = fill(names[name.removesuffix("-rebuild")](), kv)
        step(model, cache, token, routed)  # first step: warm-up (graph building, buffer growth)
        held = sum(int(c.nbytes) for c in cache)
        mx.reset_peak_memory()
        step(model, cache, token, routed)
        print(f"{name}: held {held / 2**20:.2f} MiB", flush=True)
        rows[name] = {
            "held_bytes": held,
            "decode_peak_bytes": max(0, mx.get_peak_memory() - before),
            "tokens_per_s": 0.0,
            "cache": cache,
            "routed": routed,
        }
    for _ in range(rounds):
        for row in rows.values():
            start = time.perf_counter()
            for _ in range(steps):
                step(model, row["cache"], token, row["routed"])
            row["tokens_per_s"] = max(row["tokens_per_s"], steps / (time.perf_counter() - start))
    unroute_attention(model)
    base, q4 = rows["baseline"], rows["mlx-lm-q4"]
    out = {}
    for name, row in rows.items():
        out[name] = {
            "held_bytes": row["held_bytes"],
            "decode_peak_bytes": row["decode_peak_bytes"],
            "tokens_per_s": round(row["tokens_per_s"], 2),
            "held_vs_q4": round(row["held_bytes"] / q4["held_bytes"], 4),
            "peak_vs_q4": round(row["decode_peak_bytes"] / q4["decode_peak_bytes"], 4),
            "speed_vs_q4": round(row["tokens_per_s"] / q4["tokens_per_s"], 3),
            "speed_vs_baseline": round(row["tokens_per_s"] / base["tokens_per_s"], 3),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=EMBEDDED_MODEL,
        help=f"kvbench model name, directory or hub id (default {EMBEDDED_MODEL})",
    )
    parser.add_argument(
        "--tiers",
        type=lambda v: tuple(t for t in v.split(",") if t),
        default=PALU_TIERS,
        help=f"palu tiers, comma-separated (default {','.join(PALU_TIERS)})",
    )
    parser.add_argument(
        "--rebuild-tier",
        default=REBUILD_TIER,
        help=f"tier also run through the path that rebuilds the history ('' for none; default {REBUILD_TIER})",
    )
    parser.add_argument(
        "--compute-dtype",
        default="same",
        choices=("same", "float32"),
        help="float32: prefill in float32 with K/V rounded to bfloat16, then decode with the model in bfloat16",
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--steps", type=int, default=8, help="decode steps per candidate per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(results_path("palu_long_decode.json")))
    parser.add_argument(
        "--calibration",
        default=None,
        help="palu-mlx calibrate file for the model ('' for none; default: the embedded model's file "
        "when --model is the embedded model, else none): adds the +cal rows",
    )
    parser.add_argument(
        "--sensitivity",
        default=None,
        metavar="PROFILE",
        help="the model's sensitivity profile (palu-mlx sensitivity), read by the +sens tiers in --tiers",
    )
    args = parser.parse_args(argv)
    calibration = args.calibration
    if calibration is None:
        calibration = str(CALIBRATION) if args.model == EMBEDDED_MODEL else ""
    model, tokenizer, info = load_model(args.model, "bfloat16", args.compute_dtype)
    text_tokens = tokenizer.encode(default_text_path().read_text(encoding="utf-8"))
    result: dict[str, Any] = {
        "calibration": calibration or None,
        "sensitivity": args.sensitivity,
        **stamp(),
        "model": info,
        "tiers": list(args.tiers),
        "prefill_dtype": "float32" if args.compute_dtype == "float32" else "bfloat16",
        "decode_dtype": "bfloat16",
        "chunk": CHUNK,
        "steps": args.steps,
        "rounds": args.rounds,
    }
    result["contexts"] = {}
    # every prefill first: with --compute-dtype float32 the model is then cast to bfloat16 for the
    # caches and decode steps (the keys and values are already rounded to bfloat16)
    prefilled = {}
    for n in args.contexts:
        tokens = mx.array((text_tokens * (n // len(text_tokens) + 1))[:n])[None]
        started = time.perf_counter()
        prefilled[n] = context_kv(model, tokens)
        print(f"prefilled {n} tokens in {time.perf_counter() - started:.0f} s", flush=True)
    if args.compute_dtype == "float32":
        model.set_dtype(mx.bfloat16)
        # materialize the cast now: lazily, the float32 weights would still count in the first
        # candidate's memory before its cache and be freed during its decode step
        mx.eval(model.parameters())
        gc.collect()
        mx.clear_cache()
    for n in args.contexts:
        kv = prefilled.pop(n)
        result["contexts"][str(n)] = measure_context(
            model,
            kv,
            args.steps,
            args.rounds,
            calibration or None,
            args.tiers,
            args.rebuild_tier or None,
            args.sensitivity,
        )
        print(json.dumps({n: result["contexts"][str(n)]}, indent=1), flush=True)
        del kv
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
