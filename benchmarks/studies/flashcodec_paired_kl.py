"""Is one cache's KL lower than another's on the same positions? A paired comparison on the real model.

``flashcodec compare`` reports each candidate's mean KL; near the bf16 noise floor (hqq 8-bit,
the 8-bit tiers) two means a few per cent apart may not differ. This script decodes the same
windows with the baseline (``DynamicCache``, bf16) and each candidate, as the kvbench long run does
(``--context`` tokens prefilled in one call, then ``--scored`` tokens fed one per call, teacher
forced), keeps the KL of every scored position, and reports per candidate pair the mean
difference with a bootstrap 95% interval over positions (resampled in blocks of 16 neighbouring
positions, which are correlated).

Candidates: flashcodec tier names (each with its own attention, or the one ``--attention``
chooses, applied as compare applies it) and ``hf-hqq-q8`` / ``hf-hqq-q4`` (transformers'
``QuantizedCache``, as compare builds them).

    OMP_NUM_THREADS=1 nice -n 10 hatch run bench:python benchmarks/studies/flashcodec_paired_kl.py \\
        --candidates kivi64r-k8v8-w32-s8,hf-hqq-q8
    # writes benchmarks/results/flashcodec_paired_kl.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashcodec"))  # common.py
from common import log_probs, model_and_text, stamp, study_tier
from flashcodec.compare import PEERS
from kvbench.models import resolve_model
from kvbench.results import results_path, write_json

BLOCK = 16


def make_cache(model, name: str, attention: str | None = None):
    """``(cache factory, context manager for its attention)`` for a tier (with its own attention,
    or ``attention``) or a peer name."""
    if name in PEERS:
        from transformers import QuantizedCache

        backend, nbits = PEERS[name]
        return lambda: QuantizedCache(
            backend=backend, config=model.config, nbits=nbits
        ), contextlib.nullcontext
    from flashcodec.hf import FlashCodecCache, attending_on

    t = study_tier(name, attention)
    return lambda: FlashCodecCache.from_config(model.config, codec=t.codec), lambda: attending_on(
        model, t.attention
    )


def block_bootstrap(diff: torch.Tensor, rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean of ``diff`` (positions in order), resampling blocks of :data:`BLOCK`."""
    n = diff.numel() // BLOCK * BLOCK
    blocks = diff[:n].view(-1, BLOCK).mean(-1)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, blocks.numel(), (rounds, blocks.numel()), generator=g)
    means = blocks[idx].mean(-1).sort().values
    return float(means[int(0.025 * rounds)]), float(means[int(0.975 * rounds) - 1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", default="kivi64r-k8v8-w32-s8,hf-hqq-q8")
    parser.add_argument(
        "--attention",
        choices=("codes", "materialized"),
        default=None,
        help="the attention of every tier candidate (default: each tier's own)",
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--context", type=int, default=1792)
    parser.add_argument("--scored", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = [n.strip() for n in args.candidates.split(",") if n.strip()]
    model, ids = model_and_text(resolve_model(args.model))
    size = args.context + args.scored
    windows = [ids[i * size : (i + 1) * size] for i in range(args.windows)]
    t0 = time.perf_counter()
    base = [log_probs(model, _dynamic(model), w, args.context) for w in windows]
    kls: dict[str, torch.Tensor] = {}
    top1: dict[str, float] = {}
    for name in names:
        factory, attention = make_cache(model, name, args.attention)
        per, agree = [], []
        with attention():
            for w, ref in zip(windows, base, strict=True):
                lp = log_probs(model, factory(), w, args.context)
                per.append((ref.exp() * (ref - lp)).sum(-1))
                agree.append((ref.argmax(-1) == lp.argmax(-1)).float())
        kls[name] = torch.cat(per)
        top1[name] = float(torch.cat(agree).mean())
        print(f"{name:26s} KL {float(kls[name].mean()):.4e}  top-1 {top1[name]:.4f}", flush=True)
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            diff = kls[a] - kls[b]
            lo, hi = block_bootstrap(diff)
            pairs.append(
                {
                    "a": a,
                    "b": b,
                    "kl_a_minus_b": float(diff.mean()),
                    "ci95": [lo, hi],
                    "a_lower_share": float((diff < 0).float().mean()),
                }
            )
            print(f"{a} - {b}: {float(diff.mean()):+.3e}  95% [{lo:+.3e}, {hi:+.3e}]")
    out = args.out or results_path("flashcodec_paired_kl.json")
    write_json(
        out,
        {
            "stamp": stamp(["flashcodec-kv", "kvbench", "torch", "transformers", "hqq"]),
            "model": args.model,
            "dtype": "bfloat16",
            "protocol": "teacher-forced decode as the kvbench long run; KL per scored position against the "
            f"bf16 DynamicCache; bootstrap over blocks of {BLOCK} positions",
            "windows": args.windows,
            "context_tokens": args.context,
            "scored_tokens": args.scored,
            "positions": int(next(iter(kls.values())).numel()) if kls else 0,
            "command": "python benchmarks/studies/flashcodec_paired_kl.py " + " ".join(argv or sys.argv[1:]),
            "rows": [
                {
                    "name": n,
                    **_attention_field(n, args.attention),
                    "kl_mean": float(kls[n].mean()),
                    "top1_agreement": top1[n],
                }
                for n in names
            ],  # fmt: skip
            "pairs": pairs,
            "wall_s": time.perf_counter() - t0,
        },
    )
    print(f"wrote {out}")
    return 0


def _attention_field(name: str, attention: str | None) -> dict:
    """``{"attention": ...}`` for a tier candidate, nothing for a peer."""
    return {} if name in PEERS else {"attention": study_tier(name, attention).attention}


def _dynamic(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


if __name__ == "__main__":
    sys.exit(main())
