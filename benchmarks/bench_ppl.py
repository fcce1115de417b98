"""Perplexity of a causal LM on held-out text, per flashcodec tier.

Question: how much does each codec tier cost in next-token quality, and what does it save?

Text: ``load_corpus("heldout")`` (committed, never trained on), tokenized and cut into
``--seqs`` consecutive windows of ``--seq-len`` tokens (default 16 x 512; the embedded model's
context is 2048). Each tier is ``FlashCodecCache.from_config(model.config, **tier)``.

Two ways to feed the cache, both reported:

* ``ppl`` (decode order, the headline): the window goes through the cache's own ``update`` in
  chunks that end just before a block would complete (:func:`decode_order_chunks`), so every
  token attends over exactly what it would see in a token-by-token ``generate``: earlier blocks
  reconstructed, the current block's earlier tokens raw (the block's last token sees its block
  reconstructed, as in decoding). ``decode_check`` verifies this per tier against a real
  token-by-token decode on the first ``--check-tokens`` tokens (max logit difference).
* ``ppl_prefill``: one forward of the whole window through the cache. Complete blocks of the
  window are archived before attention runs, so a token also sees the reconstruction of its own
  block, which depends on later tokens of that block: a within-block look-ahead that generation
  never has. Reported to show that caveat, not as the quality figure.

Storage: ``storage_bytes()`` of the cache after each window, measured (``held`` = archive + raw
tail, ``raw`` = what a plain cache would hold), summed over windows; ``ratio = held / raw``.

    hatch run bench:python benchmarks/bench_ppl.py                # embedded model
    hatch run bench:python benchmarks/bench_ppl.py --model PATH    # any causal LM directory
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from bench_reconstruct import stamp
from corpus import load_corpus
from flashcodec.hf import FlashCodecCache

RESULTS = Path(__file__).resolve().parent / "results" / "flashcodec_ppl.json"

#: the description's tiers, r = 8 (None = the unpatched model with transformers' DynamicCache)
TIERS: dict[str, dict[str, Any] | None] = {
    "baseline": None,
    "png keep=1.0": dict(mode="png", keep_ratio=1.0),
    "jpeg k=8": dict(mode="jpeg", keep_freqs=8),
    "jpeg k=8 int8": dict(mode="jpeg", keep_freqs=8, quant_bits=8),
    "jpeg k=4": dict(mode="jpeg", keep_freqs=4),
    "jpeg k=2": dict(mode="jpeg", keep_freqs=2),
    "jpeg k=2 int8": dict(mode="jpeg", keep_freqs=2, quant_bits=8),
}


def decode_order_chunks(length: int, block: int) -> list[tuple[int, int]]:
    """``(start, stop)`` token ranges whose forwards see exactly what a token-by-token decode sees.

    In ``generate``, appending token ``p`` archives its block when ``p`` completes it, so the
    last token of a block attends over its own block *reconstructed*, while the other tokens see
    their block's earlier tokens raw. Chunks ``[0, r-1), [r-1, 2r-1), ...`` reproduce that with
    the cache's own ``update``: each chunk completes a block only with its first token and leaves
    the rest of the next block in the raw tail.
    """
    edges = [0, *range(block - 1, length, block), length]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def window_nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL of ``ids [B, S]`` under ``logits [B, S, V]`` (``B * (S - 1)`` predictions)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(2, ids[:, 1:, None]).sum().item()
    return nll, ids.shape[0] * (ids.shape[1] - 1)


@torch.no_grad()
def decode_order_logits(model, ids: torch.Tensor, tier: dict[str, Any], block: int):
    """Logits ``[B, S, V]`` of ``ids [B, S]`` fed in :func:`decode_order_chunks` through a FlashCodecCache."""
    cache = FlashCodecCache.from_config(model.config, **tier)
    chunks = decode_order_chunks(ids.shape[1], block)
    return torch.cat([model(ids[:, a:b], cache=cache).logits for a, b in chunks], dim=1), cache


@torch.no_grad()
def token_by_token_logits(model, ids: torch.Tensor, tier: dict[str, Any]) -> torch.Tensor:
    """Logits ``[1, S, V]`` from a real decode: one token per forward through a plain FlashCodecCache."""
    cache = FlashCodecCache.from_config(model.config, **tier)
    return torch.cat([model(ids[:, i : i + 1], cache=cache).logits for i in range(ids.shape[1])], dim=1)


def load_model(path: str | None):
    """The model at ``path`` (default: the embedded tiny Qwen3) in eval mode, float32, and its tokenizer."""
    from kvspec.models import embedded_model_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(path) if path else embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir), model_dir


def heldout_windows(tokenizer, n: int, length: int, context: int) -> torch.Tensor:
    """``n`` consecutive windows of the tokenized held-out text, ``[n, length]`` int64 (fewer if it runs out)."""
    length = min(length, context)
    ids = tokenizer(load_corpus("heldout"), return_tensors="pt", verbose=False).input_ids[0]
    n = min(n, ids.shape[0] // length)
    return ids[: n * length].reshape(n, length)


def model_record(model, model_dir: Path) -> dict[str, Any]:
    cfg = model.config.get_text_config(decoder=True)
    return {
        "path": os.path.relpath(model_dir, Path(__file__).resolve().parent.parent)
        if Path(model_dir).resolve().is_relative_to(Path(__file__).resolve().parent.parent)
        else str(model_dir),
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "layer_types": list(getattr(cfg, "layer_types", None) or []),
        "dtype": str(model.dtype).split(".")[-1],
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_sha256": {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(Path(model_dir).glob("*.safetensors"))
        },
    }


def evaluate(model, batches: list[torch.Tensor], tier: dict[str, Any] | None, block: int) -> dict[str, Any]:
    """Perplexities (decode order and prefill) and measured storage of one tier over ``batches [B, S]``."""
    nll = nll_prefill = 0.0
    count = 0
    held = raw = 0
    codec_layers = None
    t0 = time.perf_counter()
    for ids in batches:
        with torch.no_grad():
            if tier is None:
                logits = model(ids).logits
                logits_prefill = logits
            else:
                logits, cache = decode_order_logits(model, ids, tier, block)
                storage = cache.storage_bytes()
                held, raw = held + storage.held, raw + storage.raw
                codec_layers = f"{len(cache.codec_layer_indices)}/{len(cache.layers)}"
                prefill_cache = FlashCodecCache.from_config(model.config, **tier)
                logits_prefill = model(ids, cache=prefill_cache).logits
        a, n = window_nll(logits, ids)
        b, _ = window_nll(logits_prefill, ids)
        nll, nll_prefill, count = nll + a, nll_prefill + b, count + n
    row: dict[str, Any] = {
        "config": tier,
        "ppl": math.exp(nll / count),
        "ppl_prefill": math.exp(nll_prefill / count),
        "predictions": count,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if tier is not None:
        row.update(codec_layers=codec_layers, held_bytes=held, raw_bytes=raw, storage_ratio=held / raw)
    return row


def decode_check(model, ids: torch.Tensor, tier: dict[str, Any], block: int) -> dict[str, float]:
    """Max |logit difference| between decode-order feeding and a real token-by-token decode."""
    a, _ = decode_order_logits(model, ids, tier, block)
    b = token_by_token_logits(model, ids, tier)
    return {"tokens": ids.shape[1], "max_abs_logit_diff": float((a - b).abs().max())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=os.environ.get("FLASHCODEC_MODEL"), help="model directory (default: embedded)"
    )
    p.add_argument("--seqs", type=int, default=16, help="held-out windows (default 16)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch", type=int, default=16, help="windows per forward (default 16)")
    p.add_argument(
        "--check-tokens", type=int, default=40, help="tokens of the token-by-token check (default 40)"
    )
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
    context = int(
        getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", args.seq_len)
    )
    windows = heldout_windows(tokenizer, args.seqs, args.seq_len, context)
    batches = list(windows.split(args.batch))
    block = 8
    rows = {}
    for name, tier in TIERS.items():
        tier = None if tier is None else dict(tier, block_size=block)
        rows[name] = evaluate(model, batches, tier, block)
        if tier is not None:
            rows[name]["decode_check"] = decode_check(model, windows[:1, : args.check_tokens], tier, block)
        base = rows["baseline"]["ppl"]
        rows[name]["delta_ppl"] = rows[name]["ppl"] - base
        print(
            f"{name:>14}: ppl {rows[name]['ppl']:.4f} ({rows[name]['delta_ppl']:+.4f})  "
            f"prefill {rows[name]['ppl_prefill']:.4f}  storage {rows[name].get('storage_ratio', 1.0):.3f}  "
            f"[{rows[name]['seconds']}s]",
            flush=True,
        )
    result = {
        "benchmark": "flashcodec perplexity per tier on held-out text",
        **stamp(),
        "model": model_record(model, model_dir),
        "text": {
            "source": "benchmarks/data/heldout.txt via corpus.load_corpus('heldout')",
            "sha256": hashlib.sha256(load_corpus("heldout").encode()).hexdigest(),
            "windows": windows.shape[0],
            "tokens_per_window": windows.shape[1],
        },
        "method": {
            "ppl": f"decode order: windows fed through FlashCodecCache.update in chunks [0, {block - 1}), "
            f"[{block - 1}, {2 * block - 1}), ...: every token attends what it attends in a token-by-token generate",
            "ppl_prefill": "one forward of the whole window through the cache (complete blocks archived before "
            "attention: within-block look-ahead)",
            "decode_check": "max |logit diff| of decode-order chunks vs a real token-by-token decode "
            "(one token per forward), first window",
            "storage": "FlashCodecCache.storage_bytes() after each window (decode order), summed: held / raw",
            "block_size": block,
        },
        "rows": rows,
    }
    result["versions"]["transformers"] = __import__("transformers").__version__
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
