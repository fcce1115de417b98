"""Benchmark palu-mlx: reconstruction error per bit, perplexity, decode speed and memory.

    hatch run bench:python benchmarks/bench_palu.py                 # both parts
    hatch run bench:python benchmarks/bench_palu.py --part reconstruction
    hatch run bench:python benchmarks/bench_palu.py --part model --windows 2   # quicker

Part ``reconstruction`` -> ``benchmarks/results/palu_reconstruction.json``: relative
Frobenius error of K and V against bits per element for palu tiers and the naive uniform
2/4-bit baseline, on every kvspec test vector of the planted, random-walk, gaussian,
outlier and real families (each vector: half of it as the prefill, the rest in 8-token appends).

Part ``model`` -> ``benchmarks/results/palu_model.json`` (needs the embedded model):

* held-out perplexity of the embedded tiny qwen3 with mlx-lm's ``KVCache`` (the baseline),
  palu tiers, mlx-lm's ``QuantizedKVCache`` at 8 and 4 bits and the naive 2-bit cache.
  Each window of ``--window`` tokens is fed as a ``--prefix``-token prefill and then
  ``--chunk``-token appends; only tokens predicted after the prefill are scored, so every
  scored prediction attends over keys/values that went through the cache's codec.
* decode tokens/s and peak memory (``mx.get_peak_memory``) as ratios to ``KVCache``, after
  a prefill of 512 and 2,048 tokens, measured side by side in one run; plus the bytes each
  cache holds (``nbytes``).

All figures are measured in this run; nothing is copied from elsewhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
sys.path.insert(0, str(BENCH_DIR))

import kvspec  # noqa: E402
import mlx_lm  # noqa: E402
import palu_mlx  # noqa: E402
from kvspec.vectors import load_vectors  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache  # noqa: E402
from palu_mlx import KVCacheConfig, NaiveQuantKVCache, PaluKVCache, naive_roundtrip  # noqa: E402

FAMILIES = ("planted_lowrank", "random_walk", "gaussian", "outlier_keys", "real")

# name -> palu config (head_dim None: the vector's D; one head group so every H divides)
PALU_TIERS: dict[str, dict] = {
    "palu full-rank-fp16": dict(palu_rank=64, palu_hi_bit=16, palu_lo_bit=16),
    "palu r16-fp16": dict(palu_rank=16, palu_hi_bit=16, palu_lo_bit=16),
    "palu e0.99 4/2-bit": dict(palu_energy_threshold=0.99),
    "palu r16 4/2-bit": dict(palu_rank=16),
    "palu default": dict(),
    "palu default fp16-values": dict(palu_quantize_values=False),
    "palu r8-4bit": dict(palu_rank=8, palu_hi_bit=4, palu_lo_bit=4),
}


def stamp() -> dict:
    import mlx_lm as lm

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "mlx_device": str(mx.default_device()),
        },
        "versions": {
            "python": platform.python_version(),
            "mlx": mx.__version__,
            "mlx_lm": lm.__version__,
            "numpy": np.__version__,
            "palu_mlx": palu_mlx.__version__,
            "kvspec": kvspec.__version__,
        },
        "command": "python benchmarks/bench_palu.py " + " ".join(sys.argv[1:]),
    }


def rel_err(x_hat: np.ndarray, x: np.ndarray) -> float:
    x64, y64 = x.astype(np.float64), x_hat.astype(np.float64)
    return float(np.linalg.norm(y64 - x64) / np.linalg.norm(x64))


def to_mx(array: np.ndarray, dtype: str) -> mx.array:
    return mx.array(array.astype(np.float32)).astype(getattr(mx, dtype))


def to_np(array: mx.array) -> np.ndarray:
    return np.array(array.astype(mx.float32))


# =========================================================================== reconstruction
def palu_on_vector(vector, overrides: dict) -> dict:
    cache = PaluKVCache(KVCacheConfig(method="palu", head_dim=None, palu_n_head_groups=1, **overrides))
    s = vector.shape[2]
    bounds = [0, s // 2, *range(s // 2 + 8, s, 8), s]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        keys, values = cache.update_and_fetch(
            to_mx(vector.keys[:, :, a:b], vector.dtype), to_mx(vector.values[:, :, a:b], vector.dtype)
        )
    elements = int(np.prod(vector.shape) + np.prod(vector.values_shape))
    state = cache.state
    state_bytes = sum(a.nbytes for a in state.values())
    token_bytes = sum(a.nbytes for name, a in state.items() if ".seg" in name or name.startswith("exact_"))
    return {
        "key_rel_err": rel_err(to_np(keys), vector.keys),
        "value_rel_err": rel_err(to_np(values), vector.values),
        "bits_per_element": 8 * state_bytes / elements,
        "bits_per_element_with_capacity": cache.effective_bits_per_element,
        "bits_per_element_per_token_arrays": 8 * token_bytes / elements,
        "assigned_avg_bits": cache.assigned_avg_bits,
        "key_rank": cache.key_rank,
        "value_rank": cache.value_rank,
        "fitted": cache.fitted,
    }


def naive_on_vector(vector, bits: int) -> dict:
    k_hat, k_bytes = naive_roundtrip(to_mx(vector.keys, vector.dtype), bits, 64)
    v_hat, v_bytes = naive_roundtrip(to_mx(vector.values, vector.dtype), bits, 64)
    elements = int(np.prod(vector.shape) + np.prod(vector.values_shape))
    return {
        "key_rel_err": rel_err(to_np(k_hat), vector.keys),
        "value_rel_err": rel_err(to_np(v_hat), vector.values),
        "bits_per_element": 8 * (k_bytes + v_bytes) / elements,
        "bits_per_element_with_capacity": 8 * (k_bytes + v_bytes) / elements,
        "bits_per_element_per_token_arrays": 8 * (k_bytes + v_bytes) / elements,
    }


def run_reconstruction() -> dict:
    vectors = [v for v in load_vectors() if v.family in FAMILIES]
    rows = []
    for vector in vectors:
        base = {
            "vector": vector.name,
            "family": vector.family,
            "dtype": vector.dtype,
            "shape": list(vector.shape),
        }
        for bits in (2, 4):
            rows.append({**base, "method": f"naive {bits}-bit (group 64)", **naive_on_vector(vector, bits)})
        for name, overrides in PALU_TIERS.items():
            rows.append({**base, "method": name, **palu_on_vector(vector, overrides)})
        print(f"  {vector.name}: done", flush=True)

    # per family and method: mean errors and bits, and palu default vs naive 2-bit
    summary: dict[str, dict] = {}
    for family in sorted({r["family"] for r in rows}):
        fam = [r for r in rows if r["family"] == family]
        per_method = {}
        for method in dict.fromkeys(r["method"] for r in fam):
            sel = [r for r in fam if r["method"] == method]
            per_method[method] = {
                k: float(np.mean([r[k] for r in sel]))
                for k in (
                    "key_rel_err",
                    "value_rel_err",
                    "bits_per_element",
                    "bits_per_element_per_token_arrays",
                )
            }
        summary[family] = per_method
    verdicts = []
    for family, methods in summary.items():
        palu, naive = methods["palu default"], methods["naive 2-bit (group 64)"]
        for tensor in ("key", "value"):
            p, n = palu[f"{tensor}_rel_err"], naive[f"{tensor}_rel_err"]
            verdicts.append(
                {
                    "family": family,
                    "tensor": tensor,
                    "palu_default_rel_err": p,
                    "naive_2bit_rel_err": n,
                    "palu_default_bits": palu["bits_per_element"],
                    "naive_2bit_bits": naive["bits_per_element"],
                    "palu_wins": p < n,
                }
            )
    return {
        **stamp(),
        "definitions": {
            "rel_err": "||x_hat - x||_F / ||x||_F over the whole vector after the stream",
            "bits_per_element": "8 * bytes of the arrays in cache.state (codes, scales, biases, projections, "
            "means, singular values; cut to the tokens held) / (B*H*S*(D+Dv))",
            "bits_per_element_per_token_arrays": "the same without the per-layer projections, means and "
            "singular values: the rate a long context tends to",
            "bits_per_element_with_capacity": "8 * cache.nbytes (buffers at their grown 256-token capacity) / elements",
            "stream": "prefill of S//2 tokens, then 8-token appends",
            "palu tiers": {k: v or "defaults" for k, v in PALU_TIERS.items()},
            "palu common": "head_dim=None, palu_n_head_groups=1 (vectors have 1-4 heads), "
            "palu_min_fit_tokens=None (= D)",
        },
        "vectors": [v.name for v in vectors],
        "rows": rows,
        "summary_by_family": summary,
        "palu_default_vs_naive_2bit": verdicts,
    }


# =========================================================================== model
def heldout_tokens(model_path: Path) -> np.ndarray:
    """The held-out text encoded as in training: ``BOS doc EOS`` per document."""
    from corpus import DOC_SEPARATOR, load_corpus
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    eos_id = json.loads((model_path / "config.json").read_text())["eos_token_id"]
    docs = load_corpus("heldout").rstrip("\n").split(DOC_SEPARATOR)
    out: list[int] = []
    for enc in tok.encode_batch(docs):
        out.extend(enc.ids)
        out.append(eos_id)
    return np.asarray(out, dtype=np.int64)


def cache_factories(n_layers: int, head_dim: int) -> dict:
    def palu(**kw):
        return lambda: [
            PaluKVCache(KVCacheConfig(method="palu", head_dim=head_dim, **kw)) for _ in range(n_layers)
        ]

    return {
        "KVCache (fp32 baseline)": lambda: [KVCache() for _ in range(n_layers)],
        "palu full-rank-fp16": palu(palu_rank=head_dim, palu_hi_bit=16, palu_lo_bit=16),
        "palu r32-fp16": palu(palu_rank=32, palu_hi_bit=16, palu_lo_bit=16),
        "palu e0.99 4/2-bit": palu(palu_energy_threshold=0.99),
        "palu default": palu(),
        "palu default fp16-values": palu(palu_quantize_values=False),
        "QuantizedKVCache 8-bit": lambda: [QuantizedKVCache(group_size=64, bits=8) for _ in range(n_layers)],
        "QuantizedKVCache 4-bit": lambda: [QuantizedKVCache(group_size=64, bits=4) for _ in range(n_layers)],
        "naive 2-bit (group 64)": lambda: [NaiveQuantKVCache(2, 64) for _ in range(n_layers)],
    }


def cache_bits(caches, n_kv: int, head_dim: int) -> float:
    offset = caches[0].offset
    return 8 * sum(c.nbytes for c in caches) / (len(caches) * n_kv * offset * 2 * head_dim)


def perplexity(model, tokens, factory, window: int, prefix: int, chunk: int, windows: int, n_kv, head_dim):
    nll, count, bits, ranks = 0.0, 0, [], []
    for w in range(windows):
        seq = mx.array(tokens[w * window : (w + 1) * window + 1])
        caches = factory()
        model(seq[None, :prefix], cache=caches)
        for start in range(prefix, window, chunk):
            stop = min(start + chunk, window)
            logits = model(seq[None, start:stop], cache=caches).astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            targets = seq[start + 1 : stop + 1]
            picked = mx.take_along_axis(logprobs[0], targets[:, None], axis=-1)
            nll -= mx.sum(picked).item()
            count += stop - start
        bits.append(cache_bits(caches, n_kv, head_dim))
        if isinstance(caches[0], PaluKVCache):
            ranks.append([[c.key_rank, c.value_rank] for c in caches])
    out = {"nll": nll / count, "ppl": math.exp(nll / count), "scored_tokens": count}
    out["effective_bits_per_element"] = float(np.mean(bits))
    if ranks:
        out["palu_ranks_first_window"] = ranks[0]
    return out


def decode_speed(model, tokens, factory, context: int, steps: int, n_kv: int, head_dim: int) -> dict:
    caches = factory()
    mx.eval(model.parameters())
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    prompt = mx.array(tokens[:context])
    for start in range(0, context, 512):
        model(prompt[None, start : start + 512], cache=caches)
        mx.eval([c.state for c in caches])
    token = mx.argmax(model(prompt[None, -1:], cache=caches)[:, -1], axis=-1)
    mx.eval(token)
    peak_prefill = mx.get_peak_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(token[None], cache=caches)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(token)
    elapsed = time.perf_counter() - start
    return {
        "context": context,
        "decode_steps": steps,
        "decode_tokens_per_s": steps / elapsed,
        "peak_memory_decode_bytes": mx.get_peak_memory(),
        "peak_memory_prefill_bytes": peak_prefill,
        "active_memory_before_bytes": base,
        "cache_nbytes": sum(c.nbytes for c in caches),
        "effective_bits_per_element": cache_bits(caches, n_kv, head_dim),
    }


def run_model(args) -> dict:
    model_path = kvspec.models.embedded_model_path()
    model, _ = mlx_lm.load(str(model_path))
    model_args = model.args
    n_layers, n_kv, head_dim = (
        model_args.num_hidden_layers,
        model_args.num_key_value_heads,
        model_args.head_dim,
    )
    tokens = heldout_tokens(model_path)
    factories = cache_factories(n_layers, head_dim)
    windows = min(args.windows, (len(tokens) - 1) // args.window)

    ppl = {}
    for name, factory in factories.items():
        t0 = time.perf_counter()
        ppl[name] = perplexity(
            model, tokens, factory, args.window, args.prefix, args.chunk, windows, n_kv, head_dim
        )
        print(f"  ppl {name}: {ppl[name]['ppl']:.3f} ({time.perf_counter() - t0:.1f}s)", flush=True)
    base_ppl = ppl["KVCache (fp32 baseline)"]["ppl"]
    for row in ppl.values():
        row["ppl_ratio_to_kvcache"] = row["ppl"] / base_ppl

    speed_names = [
        "KVCache (fp32 baseline)",
        "palu default",
        "palu full-rank-fp16",
        "QuantizedKVCache 4-bit",
        "naive 2-bit (group 64)",
    ]
    speed_factories = {name: factories[name] for name in speed_names}
    speed_factories["palu default, palu_check_finite=False"] = lambda: [
        PaluKVCache(KVCacheConfig(method="palu", head_dim=head_dim, palu_check_finite=False))
        for _ in range(n_layers)
    ]
    load_at_start = os.getloadavg()
    speed = {}
    for factory in speed_factories.values():
        decode_speed(model, tokens, factory, 64, 2, n_kv, head_dim)  # warm-up
    for context in args.contexts:
        # Round-robin repeats, best run kept: the CPU is shared, and a slow outlier in one
        # configuration would otherwise decide its ratio.
        runs: dict[str, list[dict]] = {name: [] for name in speed_factories}
        for _ in range(args.repeats):
            for name, factory in speed_factories.items():
                runs[name].append(decode_speed(model, tokens, factory, context, args.steps, n_kv, head_dim))
        for name in speed_factories:
            best = max(runs[name], key=lambda r: r["decode_tokens_per_s"])
            speed[f"{name} @ {context}"] = {
                "cache": name,
                **best,
                "decode_tokens_per_s_all_runs": [r["decode_tokens_per_s"] for r in runs[name]],
            }
            row = speed[f"{name} @ {context}"]
            print(
                f"  {name} @ {context}: {row['decode_tokens_per_s']:.1f} tok/s, "
                f"peak {row['peak_memory_decode_bytes'] / 2**20:.1f} MiB, cache {row['cache_nbytes'] / 2**20:.2f} MiB",
                flush=True,
            )
        base = speed[f"KVCache (fp32 baseline) @ {context}"]
        for name in speed_factories:
            row = speed[f"{name} @ {context}"]
            row["tokens_per_s_ratio_to_kvcache"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            row["peak_memory_decode_ratio_to_kvcache"] = (
                row["peak_memory_decode_bytes"] / base["peak_memory_decode_bytes"]
            )
            above = base["peak_memory_decode_bytes"] - base["active_memory_before_bytes"]
            row["peak_above_weights_ratio_to_kvcache"] = (
                row["peak_memory_decode_bytes"] - row["active_memory_before_bytes"]
            ) / above
            row["cache_nbytes_ratio_to_kvcache"] = row["cache_nbytes"] / base["cache_nbytes"]

    return {
        **stamp(),
        "model": {
            "path": str(model_path.relative_to(BENCH_DIR.parent))
            if model_path.is_relative_to(BENCH_DIR.parent)
            else str(model_path),
            "layers": n_layers,
            "kv_heads": n_kv,
            "head_dim": head_dim,
            "dtype": str(model.model.embed_tokens.weight.dtype),
            "weights_sha256": hashlib.sha256((model_path / "model.safetensors").read_bytes()).hexdigest(),
        },
        "perplexity_setup": {
            "text": "benchmarks/data/heldout.txt, BOS doc EOS per document (as in training)",
            "window": args.window,
            "prefix": args.prefix,
            "chunk": args.chunk,
            "windows": windows,
            "scored": "tokens predicted after the prefix, fed in chunk-token appends",
        },
        "perplexity": ppl,
        "speed_setup": {
            "prefill": "context tokens of the held-out stream in 512-token chunks, then one token",
            "decode": f"{args.steps} greedy steps, timed after a warm-up run at 64 tokens; "
            f"{args.repeats} round-robin repeats over the caches, the fastest run kept",
            "load_average_at_start": list(load_at_start),
            "load_average_at_end": list(os.getloadavg()),
            "peak_memory": "mx.get_peak_memory() over the decode steps (reset after the prefill); "
            "active_memory_before_bytes is mx.get_active_memory() before the prefill (the weights)",
        },
        "speed": speed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=("reconstruction", "model", "all"), default="all")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--prefix", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="round-robin speed repeats (best kept)")
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.part in ("reconstruction", "all"):
        print("reconstruction:", flush=True)
        result = run_reconstruction()
        (RESULTS / "palu_reconstruction.json").write_text(json.dumps(result, indent=2) + "\n")
        for v in result["palu_default_vs_naive_2bit"]:
            print(
                f"  {v['family']:>16} {v['tensor']:>5}: palu default {v['palu_default_rel_err']:.3f} "
                f"@ {v['palu_default_bits']:.2f} b/el vs naive 2-bit {v['naive_2bit_rel_err']:.3f} "
                f"@ {v['naive_2bit_bits']:.2f} b/el (palu per-token arrays alone: "
                f"{result['summary_by_family'][v['family']]['palu default']['bits_per_element_per_token_arrays']:.2f})"
            )
    if args.part in ("model", "all"):
        try:
            kvspec.models.embedded_model_path()
        except FileNotFoundError as exc:
            print(f"model part skipped: {exc}")
            return 0 if args.part == "all" else 1
        print("model:", flush=True)
        result = run_model(args)
        (RESULTS / "palu_model.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
