"""The transformers demo: one line of hot patch, then greedy generation per codec tier.

Question: per tier, how much K/V memory does the codec hold next to a plain cache, and how close
are the generated tokens to the unpatched model's?

For each tier, ``apply_flash_codec(model, **tier)`` patches this model's ``generate``; every prompt
is generated greedily (``--new-tokens``, default 48) and compared position by position with the
unpatched model's continuation (token match, first divergence). Storage is measured from the
returned cache (``out.cache.storage_bytes()``: held = archive + raw tail, raw = what a plain cache
holds for the same tokens). ``remove_flash_codec`` then restores the model, and one more
generation checks it gives the baseline tokens again. A hybrid-layer audit runs the same on the
random-weight hybrid fixture (linear + full attention): codec layers, warnings, token match.

Prompts: ``--prompts`` windows of ``--prompt-tokens`` tokens spread over the held-out text, or
``--prompt TEXT``.

    hatch run bench:python benchmarks/run_model_demo.py                 # embedded model
    FLASHCODEC_MODEL=/path/to/model hatch run bench:python benchmarks/run_model_demo.py
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from bench_ppl import load_model, model_record
from bench_reconstruct import stamp
from corpus import load_corpus
from flashcodec import CodecStorage
from flashcodec.hf import apply_flash_codec, remove_flash_codec

RESULTS = Path(__file__).resolve().parent / "results" / "flashcodec_demo.json"

#: the description's demo tiers (r = 8)
TIERS: dict[str, dict[str, Any]] = {
    "png keep=1.0": dict(mode="png", block_size=8, keep_ratio=1.0),
    "jpeg k=8 int8": dict(mode="jpeg", block_size=8, keep_freqs=8, quant_bits=8),
    "jpeg k=4": dict(mode="jpeg", block_size=8, keep_freqs=4),
    "jpeg k=2": dict(mode="jpeg", block_size=8, keep_freqs=2),
    "jpeg k=2 int8": dict(mode="jpeg", block_size=8, keep_freqs=2, quant_bits=8),
}


def greedy(model, ids: torch.Tensor, new_tokens: int):
    """Greedy continuation of ``ids [1, S]``: exactly ``new_tokens`` tokens, with the generate output."""
    return model.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
    )


def compare(new: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Position-wise agreement of two continuations ``[N]``: match share and first divergence (or None)."""
    same = new == ref
    diverged = (~same).nonzero()
    return {
        "token_match": same.float().mean().item(),
        "first_divergence": None if diverged.numel() == 0 else int(diverged[0]),
    }


def run_tiers(model, prompts: list[torch.Tensor], new_tokens: int, decode) -> tuple[dict, dict]:
    """Baseline and every tier on ``prompts``; returns (baseline record, {tier: record})."""
    baseline, t0 = [], time.perf_counter()
    for ids in prompts:
        baseline.append(greedy(model, ids, new_tokens).sequences[0, ids.shape[1] :])
    base_s = time.perf_counter() - t0
    base_record = {
        "tokens_per_s": len(prompts) * new_tokens / base_s,
        "texts": [decode(b) for b in baseline],
    }
    rows = {}
    for name, tier in TIERS.items():
        storage, matches, texts = CodecStorage(), [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            apply_flash_codec(model, **tier)
            t0 = time.perf_counter()
            try:
                for ids, ref in zip(prompts, baseline, strict=True):
                    out = greedy(model, ids, new_tokens)
                    storage = storage + out.cache.storage_bytes()
                    layers = f"{len(out.cache.codec_layer_indices)}/{len(out.cache.layers)}"
                    new = out.sequences[0, ids.shape[1] :]
                    matches.append(compare(new, ref))
                    texts.append(decode(new))
            finally:
                seconds = time.perf_counter() - t0
                remove_flash_codec(model)
        restored = greedy(model, prompts[0], new_tokens).sequences[0, prompts[0].shape[1] :]
        rows[name] = {
            "config": tier,
            "codec_layers": layers,
            "storage": storage.as_dict(),
            "storage_vs_raw": storage.ratio,
            "token_match": sum(m["token_match"] for m in matches) / len(matches),
            "identical_prompts": sum(m["first_divergence"] is None for m in matches),
            "per_prompt": matches,
            "tokens_per_s": len(prompts) * new_tokens / seconds,
            "warnings": [str(w.message) for w in caught],
            "restored_after_remove": bool(torch.equal(restored, baseline[0])),
            "texts": texts,
        }
        print(
            f"{name:>14}: storage {storage.ratio:6.1%} of raw  token match {rows[name]['token_match']:6.1%}  "
            f"identical {rows[name]['identical_prompts']}/{len(prompts)}  layers {layers}  "
            f"warnings {len(caught)}  restored {rows[name]['restored_after_remove']}",
            flush=True,
        )
    return base_record, rows


def hybrid_audit(new_tokens: int, n_prompts: int) -> dict[str, Any]:
    """The same tiers on the random-weight hybrid fixture (random prompt ids: no text)."""
    from hybrid_fixture import make_tiny_hybrid_model

    model = make_tiny_hybrid_model(seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (1, 24), generator=g) for _ in range(n_prompts)]
    base, rows = run_tiers(model, prompts, new_tokens, decode=lambda t: t.tolist())
    for row in rows.values():
        row.pop("texts")
    return {
        "model": "benchmarks/hybrid_fixture.py make_tiny_hybrid_model(seed=0), random weights",
        "layer_types": list(model.config.layer_types),
        "rows": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=os.environ.get("FLASHCODEC_MODEL"), help="model directory (default: embedded)"
    )
    p.add_argument("--new-tokens", type=int, default=int(os.environ.get("FLASHCODEC_NEW_TOKENS", 48)))
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--prompt", default=None, help="one prompt text instead of held-out windows")
    p.add_argument("--no-hybrid", action="store_true", help="skip the hybrid-fixture audit")
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
    model, tokenizer, model_dir = load_model(args.model)
    if args.prompt is not None:
        prompts = [tokenizer(args.prompt, return_tensors="pt").input_ids]
    else:
        ids = tokenizer(load_corpus("heldout"), return_tensors="pt", verbose=False).input_ids[0]
        stride = ids.shape[0] // args.prompts
        prompts = [ids[None, i * stride : i * stride + args.prompt_tokens] for i in range(args.prompts)]

    def decode(t: torch.Tensor) -> str:
        return tokenizer.decode(t, skip_special_tokens=True)

    print(f"model {model_dir}: {len(prompts)} prompts x {args.new_tokens} greedy tokens", flush=True)
    base, rows = run_tiers(model, prompts, args.new_tokens, decode)
    result = {
        "benchmark": "flashcodec transformers demo: hot patch per tier, storage vs raw KV and token match",
        **stamp(),
        "model": model_record(model, model_dir),
        "generation": {
            "greedy": True,
            "new_tokens": args.new_tokens,
            "prompts": [decode(p[0]) for p in prompts],
        },
        "method": {
            "patch": "apply_flash_codec(model, **tier) ... remove_flash_codec(model)",
            "storage": "out.cache.storage_bytes() summed over prompts: held (archive + raw tail) / raw, measured",
            "token_match": "share of positions where the tier's greedy token equals the unpatched model's",
            "restored_after_remove": "a generation after remove_flash_codec equals the baseline",
        },
        "baseline": base,
        "rows": rows,
    }
    if not args.no_hybrid:
        print("hybrid fixture audit:", flush=True)
        result["hybrid_audit"] = hybrid_audit(min(args.new_tokens, 32), 2)
    result["versions"]["transformers"] = __import__("transformers").__version__
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
