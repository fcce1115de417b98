"""End-to-end greedy decode on the embedded model with a long prompt: baseline, materialized, materialization-free.

Question: what do the three tiers cost in decode speed and memory on a whole model?

* ``baseline``: transformers' ``DynamicCache`` (raw K/V);
* ``materialized``: :class:`flashcodec.hf.FlashCodecCache` (codec archive + the memoized view
  every decode step attends over);
* ``materialization_free``: the same cache with :func:`flashcodec.hf.apply_codec_attention`:
  decode steps attend on the stored rows, the prefill's view is released on the first step
  (backend ``auto``: torch on the CPU, the Triton kernel on CUDA).

Each codec tier (``--tiers``) is run for the two codec paths. The prompt is the first
``--prompt-tokens`` tokens of the committed held-out text (``benchmarks/data/heldout.txt``); the
decode is ``--new-tokens`` greedy steps written out as the loop ``generate`` runs (one forward
per token, argmax), so prefill and decode are timed apart.

Figures per run:

* ``decode_tokens_per_s``: new tokens / decode-loop seconds (min over ``--repeats`` runs);
* ``peak_bytes``: high-water mark of tensors allocated during prefill + decode and alive at once
  (weights excluded). CPU: :class:`peak_memory.PeakMemory` (aten dispatch tracker), in a separate
  pass from the timing; CUDA: ``torch.cuda.max_memory_allocated`` minus the bytes before the run;
* ``steady_bytes``: bytes the cache holds after the decode, measured from its tensors (baseline:
  the ``DynamicCache`` keys and values; codec: ``storage_bytes().resident`` = archive capacity +
  tail buffers + the memoized view, if any);
* ``token_match_vs_baseline`` and ``tokens_equal_materialized``;
* ``decode_steps_on_stored_rows`` / ``fallbacks``: the wrapper's counters over every run of the
  tier (the timed repeats and the memory pass), per layer call.

    hatch run torch:python benchmarks/bench_e2e.py          # writes results/flashcodec_e2e.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from flashcodec.hf import FlashCodecCache, apply_codec_attention, remove_codec_attention
from kvspec.models import embedded_model_path
from kvspec.report import environment_stamp, write_json
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from corpus import load_corpus  # noqa: E402
from peak_memory import PeakMemory  # noqa: E402

RESULTS = HERE / "results"

TIERS = {
    "jpeg k=2 int8": dict(mode="jpeg", block_size=8, keep_freqs=2, quant_bits=8),
    "jpeg k=8 int8": dict(mode="jpeg", block_size=8, keep_freqs=8, quant_bits=8),
    "png keep=1.0": dict(mode="png", block_size=8, keep_ratio=1.0),
}


def cache_bytes(cache) -> int:
    """Bytes the cache holds, measured from its tensors."""
    if isinstance(cache, FlashCodecCache):
        return cache.storage_bytes().resident + cache.native_nbytes()
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy(model, ids: torch.Tensor, cache, new_tokens: int) -> tuple[list[int], float, float]:
    """Prefill then ``new_tokens - 1`` decode steps; returns (tokens, prefill s, decode s)."""
    device = ids.device
    sync(device)
    t0 = time.perf_counter()
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits  # as generate does
    token = logits[:, -1:].argmax(-1)
    sync(device)
    t1 = time.perf_counter()
    tokens = [int(token)]
    for _ in range(new_tokens - 1):
        logits = model(token, cache=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        tokens.append(int(token))
    sync(device)
    return tokens, t1 - t0, time.perf_counter() - t1


def make_cache(model, tier: dict | None):
    return (
        DynamicCache(config=model.config)
        if tier is None
        else FlashCodecCache.from_config(model.config, **tier)
    )


def run_tier(model, ids, tier, new_tokens, repeats, device) -> dict:
    best = None
    for _ in range(repeats):
        cache = make_cache(model, tier)
        tokens, prefill_s, decode_s = greedy(model, ids, cache, new_tokens)
        if best is None or decode_s < best[2]:
            best = (tokens, prefill_s, decode_s)
        steady = cache_bytes(cache)
        del cache
    tokens, prefill_s, decode_s = best
    # memory pass, apart from the timing
    cache = make_cache(model, tier)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        greedy(model, ids, cache, new_tokens)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        with PeakMemory() as tracker:
            greedy(model, ids, cache, new_tokens)
        peak = tracker.peak
    return {
        "decode_tokens_per_s": (new_tokens - 1) / decode_s,
        "decode_ms_per_token": decode_s * 1e3 / (new_tokens - 1),
        "prefill_s": prefill_s,
        "peak_bytes": peak,
        "steady_bytes": steady,
        "tokens": tokens,
    }


def run(args) -> dict:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(load_corpus("heldout"), return_tensors="pt").input_ids[:, : args.prompt_tokens].to(device)
    rows = {"baseline": run_tier(model, ids, None, args.new_tokens, args.repeats, device)}
    print(line("baseline", rows["baseline"]), flush=True)
    base_tokens = rows["baseline"]["tokens"]
    for name in args.tiers:
        tier = TIERS[name]
        mat = run_tier(model, ids, tier, args.new_tokens, args.repeats, device)
        stats = apply_codec_attention(model, backend=args.backend)
        try:
            free = run_tier(model, ids, tier, args.new_tokens, args.repeats, device)
        finally:
            remove_codec_attention(model)
        free["decode_steps_on_stored_rows"] = stats.coded
        free["fallbacks"] = dict(stats.fallbacks)
        for row in (mat, free):
            same = sum(a == b for a, b in zip(row["tokens"], base_tokens, strict=True))
            row["token_match_vs_baseline"] = same / len(base_tokens)
        free["tokens_equal_materialized"] = free["tokens"] == mat["tokens"]
        free["speed_ratio_vs_materialized"] = free["decode_tokens_per_s"] / mat["decode_tokens_per_s"]
        free["steady_ratio_materialized_over_this"] = mat["steady_bytes"] / free["steady_bytes"]
        free["peak_ratio_materialized_over_this"] = mat["peak_bytes"] / free["peak_bytes"]
        rows[f"{name} / materialized"] = mat
        rows[f"{name} / materialization-free"] = free
        print(line(f"{name} / materialized", mat), flush=True)
        print(line(f"{name} / materialization-free", free), flush=True)
    stamp = environment_stamp(["torch", "transformers", "triton", "flashcodec-kv", "kvcache-spec"])
    stamp["machine"].update(
        torch_threads=torch.get_num_threads(),
        load_average_1_5_15min=os.getloadavg(),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    )
    cfg = model.config
    return {
        "benchmark": "bench_e2e",
        "question": "greedy decode on a whole model: baseline vs materialized vs materialization-free",
        "settings": {
            "model": str(path.name),
            "layers": cfg.num_hidden_layers,
            "kv_heads": cfg.num_key_value_heads,
            "query_heads": cfg.num_attention_heads,
            "head_dim": getattr(cfg, "head_dim", None),
            "dtype": "float32",
            "prompt_tokens": int(ids.shape[1]),
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "backend": args.backend,
        },
        **stamp,
        "results": rows,
    }


def line(name: str, r: dict) -> str:
    return (
        f"{name:<36} {r['decode_tokens_per_s']:8.1f} tok/s  peak {r['peak_bytes'] / 2**20:7.2f} MiB"
        f"  steady {r['steady_bytes'] / 2**20:7.2f} MiB"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the embedded model)")
    parser.add_argument("--tiers", type=lambda s: s.split(","), default=["jpeg k=2 int8", "jpeg k=8 int8"])
    parser.add_argument("--prompt-tokens", type=int, default=1920)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=1, help="1 by default: intra-op threads stall on a shared machine"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in args.tiers:
        if name not in TIERS:
            parser.error(f"--tiers: unknown tier {name!r}; known: {list(TIERS)}")
    out = args.out or RESULTS / (
        "flashcodec_e2e.json" if args.device == "cpu" else "flashcodec_e2e_cuda.json"
    )
    data = run(args)
    write_json(out, data)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
