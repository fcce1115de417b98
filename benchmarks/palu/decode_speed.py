"""palu-mlx's decode speed on the real model beside mlx-lm's caches, side by side in one process.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        hatch run bench:python benchmarks/palu/decode_speed.py               # 1,024 and 2,048 tokens
    ... decode_speed.py --contexts 2048 --rounds 7 --steps 6 --out /tmp/scout.json
    ... decode_speed.py --decode-dtype bfloat16 --contexts 2048 --chunks \
        --out benchmarks/results/palu_decode_speed_bf16.json     # every decode step in bfloat16

Writes ``benchmarks/results/palu_decode_speed.json``. On the real model (kvbench's named
``smollm2-135m`` unless ``--model`` says otherwise), computed in float32 with its keys and values
rounded to bfloat16 before they are cached (``palu_mlx.compare.load_model(...,
compute_dtype="float32")``, as ``palu-mlx compare --compute-dtype float32`` runs it: on Linux,
MLX's CPU wheel multiplies float32 through the preloaded OpenBLAS and bfloat16 without a BLAS):

* the model prefills each context once with mlx-lm's ``KVCache`` (kvbench's held-out text,
  repeated if short); every candidate cache is then filled from those keys and values in
  512-token chunks, as a chunked prefill hands them over (palu fits on the first chunk);
* ``--decode-dtype bfloat16``: after the prefills the model is cast to bfloat16, so every decode
  step (weights, activations, every cache's attention) runs in bfloat16, as the model ships; on
  Linux that is without a BLAS, which slows every candidate, mlx-lm's quantized attention most;
* candidates take turns (A B C ... A B C ...): each round, every candidate decodes ``--steps``
  tokens, one model call each, and is trimmed back to the context afterwards, so every round of
  every candidate runs at the same context length; the load average is recorded per round;
* per candidate: the median and the best round's tokens/s, and its tokens/s over mlx-lm's
  ``QuantizedKVCache(bits=4, group_size=64)``'s **in the same round**, as the median over rounds
  (the machine is shared; pairing by round cancels most of the drift);
* per candidate also the bytes its caches hold, and one decode step's allocator peak over the
  memory allocated just before the step (the step's transient arrays: activations, attention);
* ``--chunks``: the packed path also run reading that many tokens at a time (what
  ``palu_mlx.attention.PACKED_CHUNK`` was chosen from);
* the palu tier (``--tier``; by default ``palu-2.25bit-scaled+rel``, the tier the results files
  measured; the file records which) runs twice: its attention
  reading the packed codes (``packed``, what ``latent_attention`` does by default) and reading
  the coder's float32 latents, ``CHUNK`` tokens at a time (``latents``, the path every coder
  had before the packed one; the same cache objects, so the same bytes).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from kvbench.models import default_text_path
from kvbench.results import environment_stamp, results_path, write_json

# the same prefill and cache filling as the long-context decode benchmark beside this script
from long_decode import CHUNK, context_kv, fill
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from palu_mlx import KVCacheBuilder, attention
from palu_mlx.builder import model_kv_dims
from palu_mlx.compare import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from studies.palu_tiers import tier_config  # noqa: E402  (registry and study tiers)

OUT = results_path("palu_decode_speed.json")
#: the tier measured unless ``--tier`` says otherwise: the one the speed results files recorded
TIER = "palu-2.25bit-scaled+rel"


def stamp() -> dict:
    return {
        **environment_stamp(["palu-mlx", "kvbench", "mlx", "mlx-lm"]),
        "command": " ".join(["python benchmarks/palu/decode_speed.py", *sys.argv[1:]]),
    }


def caches_for(model: Any, tier: str = TIER) -> dict[str, Callable[[], list[Any]]]:
    head_dim, _ = model_kv_dims(model)
    config = tier_config(tier, head_dim)
    return {
        "baseline": lambda: [KVCache() for _ in model.layers],
        "mlx-lm-q4": lambda: [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers],
        "mlx-lm-q8": lambda: [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers],
        tier: lambda: KVCacheBuilder.for_model(model, config),
    }


def decode(model: Any, cache: list[Any], token: mx.array, steps: int, path: str | None) -> float:
    """Seconds for ``steps`` decode steps (each evaluated), the cache trimmed back afterwards.

    ``path``: None for mlx-lm's caches; ``"packed"`` (palu's default), ``"latents"``, or
    ``"packed:<n>"`` (the packed path reading ``n`` tokens at a time).
    """
    original = attention.latent_attention
    # the routed attention calls the module's latent_attention: the same caches, another reader
    if path == "latents":
        attention.latent_attention = functools.partial(original, packed=False)
    elif path is not None and path.startswith("packed:"):
        attention.latent_attention = functools.partial(original, packed=True, chunk=int(path[7:]))
    try:
        start = time.perf_counter()
        for _ in range(steps):
            mx.eval(model(token, cache=cache))
        elapsed = time.perf_counter() - start
    finally:
        attention.latent_attention = original
    for layer in cache:
        layer.trim(steps)
    return elapsed


def measure_context(
    model: Any,
    kv: list[tuple[mx.array, mx.array]],
    steps: int,
    rounds: int,
    chunks: list[int],
    tier: str = TIER,
) -> dict:
    factories = caches_for(model, tier)
    built = {name: fill(make(), kv) for name, make in factories.items()}
    runs: dict[str, tuple[list[Any], str | None]] = {
        "baseline": (built["baseline"], None),
        "mlx-lm-q4": (built["mlx-lm-q4"], None),
        "mlx-lm-q8": (built["mlx-lm-q8"], None),
        f"{tier} (packed)": (built[tier], "packed"),
        f"{tier} (latents)": (built[tier], "latents"),
    }
    for n in chunks:
        runs[f"{tier} (packed, chunk {n})"] = (built[tier], f"packed:{n}")
    token = mx.array([[11]])
    peaks = {}
    for name, (cache, path) in runs.items():  # warm-up: graph shapes, buffer growth, tables
        decode(model, cache, token, 2, path)
        # one step's transient: the allocator's peak over what was allocated before the step
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        decode(model, cache, token, 1, path)
        peaks[name] = max(0, mx.get_peak_memory() - before)
    speeds: dict[str, list[float]] = {name: [] for name in runs}
    loads = []
    for _ in range(rounds):
        loads.append(round(os.getloadavg()[0], 2))
        for name, (cache, path) in runs.items():
            speeds[name].append(steps / decode(model, cache, token, steps, path))
    q4 = speeds["mlx-lm-q4"]
    out = {"load_average_per_round": loads, "candidates": {}}
    for name, (cache, _) in runs.items():
        tps = speeds[name]
        out["candidates"][name] = {
            "held_bytes": int(sum(layer.nbytes for layer in cache)),
            "step_peak_over_active_bytes": int(peaks[name]),
            "tokens_per_s_median": round(statistics.median(tps), 3),
            "tokens_per_s_best": round(max(tps), 3),
            "tokens_per_s_rounds": [round(x, 3) for x in tps],
            "vs_q4_median_of_rounds": round(
                statistics.median(a / b for a, b in zip(tps, q4, strict=True)), 3
            ),
            "vs_q4_best": round(max(tps) / max(q4), 3),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="kvbench model name or directory (default: the real model)"
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--steps", type=int, default=6, help="decode steps per candidate per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--chunks",
        type=int,
        nargs="*",
        default=[512, 2048],
        help="also run the packed path at these chunk sizes",
    )
    parser.add_argument("--tier", default=TIER, help=f"the palu tier to measure (default: {TIER})")
    parser.add_argument(
        "--decode-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="float32 (default): decode as the prefill computes; bfloat16: the model cast to bfloat16 "
        "after the prefills, so every decode step runs in bfloat16",
    )
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    model, tokenizer, info = load_model(args.model, "bfloat16", "float32")
    text_tokens = tokenizer.encode(default_text_path().read_text(encoding="utf-8"))
    result: dict[str, Any] = {
        **stamp(),
        "model": info,
        "tier": args.tier,
        "decode_dtype": args.decode_dtype,
        "fill_chunk": CHUNK,
        "steps": args.steps,
        "rounds": args.rounds,
        "packed_chunk": attention.PACKED_CHUNK,
        "latents_chunk": attention.CHUNK,
        "contexts": {},
    }
    # every prefill in float32 first; then, for bfloat16 decoding, the model is cast (its keys and
    # values are already bfloat16: load_model rounds them)
    prefilled = {}
    for n in args.contexts:
        tokens = mx.array((text_tokens * (n // len(text_tokens) + 1))[:n])[None]
        prefilled[n] = context_kv(model, tokens)
    if args.decode_dtype == "bfloat16":
        model.set_dtype(mx.bfloat16)
        mx.eval(model.parameters())
    for n in args.contexts:
        kv = prefilled.pop(n)
        result["contexts"][str(n)] = measure_context(
            model, kv, args.steps, args.rounds, args.chunks, args.tier
        )
        del kv
        for name, row in result["contexts"][str(n)]["candidates"].items():
            print(
                f"{n:>6} {name:<32} {row['tokens_per_s_median']:8.2f} tok/s  "
                f"x q4 {row['vs_q4_median_of_rounds']:.3f}  held {row['held_bytes'] / 2**20:.2f} MiB",
                flush=True,
            )
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
