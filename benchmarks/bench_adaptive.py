"""Per-layer codec budgets: does calibrating which layers to truncate beat a uniform setting?

Question: at equal storage, is "truncate the layers that tolerate it" better than "truncate every
layer a little"?

1. Calibration (``--calib-seqs`` held-out windows): every codec layer defaults to the
   conservative setting (``jpeg k=r``); each layer in turn gets the aggressive setting
   (``keep_freqs=--aggressive-freqs``) through ``per_layer``, and the perplexity increase it causes
   is that layer's damage.
2. Schedule: the ``--aggressive-layers`` cheapest layers get the aggressive setting
   (``per_layer={idx: {"keep_freqs": k}}``), the rest stay at ``k=r``.
3. Evaluation on *other* held-out windows (``--seqs``): the adaptive schedule against the uniform
   setting whose stored coefficients match it (same measured storage when the mean ``k`` is an
   integer), plus controls: the *most* damaging layers truncated instead, uniform aggressive,
   uniform ``k=r`` int8, and the model without a codec.

Perplexity is computed in decode order (``bench_ppl.decode_order_logits``: each token sees what it
sees in a token-by-token ``generate``); storage is measured from the cache
(``storage_bytes()``: held / raw). Damages are also summed to show whether they add up: the
adaptive schedule is scored on the calibration windows too.

    hatch run bench:python benchmarks/bench_adaptive.py     # writes results/flashcodec_adaptive.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from bench_ppl import decode_order_logits, heldout_windows, load_model, model_record, window_nll
from bench_reconstruct import stamp

RESULTS = Path(__file__).resolve().parent / "results" / "flashcodec_adaptive.json"
BLOCK = 8


def perplexity(model, batches: list[torch.Tensor], options: dict[str, Any] | None) -> dict[str, Any]:
    """Decode-order perplexity over ``batches [B, S]`` and measured storage (``options=None``: no codec)."""
    nll, count, held, raw = 0.0, 0, 0, 0
    for ids in batches:
        with torch.no_grad():
            if options is None:
                logits = model(ids).logits
            else:
                logits, cache = decode_order_logits(model, ids, options, BLOCK)
                storage = cache.storage_bytes()
                held, raw = held + storage.held, raw + storage.raw
        a, n = window_nll(logits, ids)
        nll, count = nll + a, count + n
    out: dict[str, Any] = {"ppl": math.exp(nll / count)}
    if options is not None:
        out.update(held_bytes=held, raw_bytes=raw, storage_ratio=held / raw)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=os.environ.get("FLASHCODEC_MODEL"), help="model directory (default: embedded)"
    )
    p.add_argument("--calib-seqs", type=int, default=8, help="calibration windows (default 8)")
    p.add_argument(
        "--seqs", type=int, default=16, help="evaluation windows, after the calibration ones (default 16)"
    )
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument(
        "--aggressive-freqs", type=int, default=4, help="keep_freqs of the aggressive setting (default 4)"
    )
    p.add_argument("--aggressive-layers", type=int, default=None, help="layers given it (default: half)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: 6x faster than 2 on the shared 2-core box)",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer, model_dir = load_model(args.model)
    context = int(
        getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", args.seq_len)
    )
    windows = heldout_windows(tokenizer, args.calib_seqs + args.seqs, args.seq_len, context)
    calib = list(windows[: args.calib_seqs].split(args.batch))
    evaluation = list(windows[args.calib_seqs :].split(args.batch))

    conservative = dict(mode="jpeg", block_size=BLOCK, keep_freqs=BLOCK)
    aggressive = {"keep_freqs": args.aggressive_freqs}
    from flashcodec.hf import FlashCodecCache

    codec_layers = FlashCodecCache.from_config(model.config).codec_layer_indices
    n_aggr = args.aggressive_layers if args.aggressive_layers is not None else len(codec_layers) // 2

    # 1. calibration: one layer at a time
    reference = perplexity(model, calib, conservative)["ppl"]
    damage = {}
    for idx in codec_layers:
        ppl = perplexity(model, calib, dict(conservative, per_layer={idx: aggressive}))["ppl"]
        damage[idx] = ppl - reference
        print(
            f"calibration: layer {idx} at k={args.aggressive_freqs}: ppl {ppl:.4f} ({damage[idx]:+.4f})",
            flush=True,
        )

    # 2. schedules
    ranked = sorted(codec_layers, key=lambda i: damage[i])
    cheapest, costliest = sorted(ranked[:n_aggr]), sorted(ranked[-n_aggr:]) if n_aggr else []
    mean_k = (n_aggr * args.aggressive_freqs + (len(codec_layers) - n_aggr) * BLOCK) / len(codec_layers)
    uniform_k = round(mean_k)
    schedules: dict[str, dict[str, Any] | None] = {
        "no codec": None,
        f"uniform k={BLOCK} (k=r)": conservative,
        f"adaptive ({n_aggr} cheapest layers k={args.aggressive_freqs})": dict(
            conservative, per_layer={i: aggressive for i in cheapest}
        ),
        f"uniform k={uniform_k} (equal storage)": dict(conservative, keep_freqs=uniform_k),
        f"control: {n_aggr} costliest layers k={args.aggressive_freqs}": dict(
            conservative, per_layer={i: aggressive for i in costliest}
        ),
        f"uniform k={args.aggressive_freqs}": dict(conservative, keep_freqs=args.aggressive_freqs),
        f"uniform k={BLOCK} int8": dict(conservative, quant_bits=8),
    }

    # 3. evaluation on other windows
    rows = {}
    base = None
    for name, options in schedules.items():
        row = perplexity(model, evaluation, options)
        if options is not None and base is None:
            base = row["ppl"]  # k=r: the reference every delta is taken against
        row["delta_ppl_vs_k_r"] = None if base is None else row["ppl"] - base
        row["config"] = options
        rows[name] = row
        print(f"{name:>44}: ppl {row['ppl']:.4f}  storage {row.get('storage_ratio', 1.0):.3f}", flush=True)

    adaptive_name = next(n for n in schedules if n.startswith("adaptive"))
    adaptive_on_calib = perplexity(model, calib, schedules[adaptive_name])["ppl"] - reference
    result = {
        "benchmark": "flashcodec per-layer calibration vs a uniform codec budget",
        **stamp(),
        "model": model_record(model, model_dir),
        "text": {
            "source": "benchmarks/data/heldout.txt via corpus.load_corpus('heldout')",
            "calibration_windows": args.calib_seqs,
            "evaluation_windows": windows.shape[0] - args.calib_seqs,
            "tokens_per_window": windows.shape[1],
        },
        "method": {
            "perplexity": "decode order (bench_ppl.decode_order_logits): what each token sees in generate",
            "conservative": conservative,
            "aggressive": aggressive,
            "calibration": "per codec layer: ppl with only that layer aggressive minus ppl at k=r, calibration windows",
            "schedule": f"the {n_aggr} layers with the smallest calibration damage get the aggressive setting",
            "equal_storage": f"uniform keep_freqs = round(mean k of the schedule) = round({mean_k:.3f})",
            "storage": "FlashCodecCache.storage_bytes(): held / raw, summed over windows",
        },
        "calibration": {
            "reference_ppl_k_r": reference,
            "damage_by_layer": {str(i): damage[i] for i in codec_layers},
            "cheapest_layers": cheapest,
            "costliest_layers": costliest,
            "adaptive_damage_measured": adaptive_on_calib,
            "adaptive_damage_sum_of_single_layers": sum(damage[i] for i in cheapest),
        },
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    result["versions"]["transformers"] = __import__("transformers").__version__
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
