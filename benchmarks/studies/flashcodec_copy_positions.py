"""Does a cache lose likelihood where the model copies from its context, or everywhere alike?

A cache can have a lower mean KL than another and still raise perplexity more, if its errors
fall on the tokens the text actually continues with. This splits the scored positions of long
windows in two: *copy* positions, whose true next token continues a bigram already seen in the
window (the previous token followed by this one), which a model predicts by attending to one
earlier position (an induction head), and the rest. For each cache it reports, on both sets,
the mean KL to the uncompressed model and the mean change of the true token's negative
log-likelihood (Δ NLL, nats; perplexity grows by ``exp(Δ NLL)``), each with a paired bootstrap
95% interval (the same positions resampled for the cache and the baseline), and the same change
against transformers' hqq 4-bit cache on the same positions (a negative ``dnll_vs_peer``: the
cache loses less likelihood than hqq).

Teacher-forced like kvbench: a fresh cache, one prefill of the window's context, then one token
per call. Caches: the uncompressed ``DynamicCache`` (the baseline), ``QuantizedCache(backend="hqq",
nbits=4)`` and the flashcodec tiers named by ``--tiers``, each with its own attention (the study
configurations' is on the codes, :func:`flashcodec.hf.attending_on`); bf16, the embedded model, 18 windows of 2,048 tokens of the
held-out text (all it holds), the last 512 of each scored: 9,216 positions.

    hatch run bench:python benchmarks/studies/flashcodec_copy_positions.py   # results/flashcodec_copy_positions.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashcodec"))  # common.py
from common import log_probs, model_and_text, stamp, study_tier, tier_list
from flashcodec.hf import FlashCodecCache, attending_on
from kvbench.models import embedded_model_path
from kvbench.protocol import BOOTSTRAP_RESAMPLES, Settings, text_windows
from kvbench.results import results_path, weights_digest, write_json
from transformers import DynamicCache, QuantizedCache

DEFAULT_TIERS = "jpeg-k8-int4z-w96i8,chan64-int4-w64i8"
PEER = "hf-hqq-q4"


def copy_positions(window: list[int], context: int) -> np.ndarray:
    """bool per scored position ``j`` (predicting ``window[context + j]``): whether the bigram
    ``(window[t - 1], window[t])`` occurs earlier in the window, ``t = context + j``."""
    seen: set[tuple[int, int]] = set(zip(window[: context - 1], window[1:context], strict=True))
    out = []
    for t in range(context, len(window)):
        pair = (window[t - 1], window[t])
        out.append(pair in seen)
        seen.add(pair)
    return np.array(out, dtype=bool)


def interval(values: np.ndarray, seed: int = 0) -> list[float]:
    """95% bootstrap interval of the mean of ``values`` (paired differences: one resample, both caches)."""
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (BOOTSTRAP_RESAMPLES, len(values)))].mean(axis=1)
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def summary(kl: np.ndarray, dnll: np.ndarray, vs_peer: np.ndarray | None) -> dict:
    """Mean KL, mean Δ NLL against the baseline and (optionally) against the peer, with intervals."""
    out = {
        "positions": len(kl),
        "kl_mean": float(kl.mean()),
        "dnll": float(dnll.mean()),
        "dnll_ci95": interval(dnll),
    }
    if vs_peer is not None:
        out["dnll_vs_peer"] = float(vs_peer.mean())
        out["dnll_vs_peer_ci95"] = interval(vs_peer)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", type=tier_list, default=tier_list(DEFAULT_TIERS))
    parser.add_argument("--windows", type=int, default=18)
    parser.add_argument("--context-tokens", type=int, default=1536)
    parser.add_argument("--scored-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=results_path("flashcodec_copy_positions.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = embedded_model_path()
    model, tokens = model_and_text(path)
    settings = Settings(
        windows=args.windows,
        context_tokens=args.context_tokens,
        scored_tokens=args.scored_tokens,
        new_tokens=1,
    )
    windows = text_windows(tokens, settings)
    ctx = args.context_tokens
    makers = {
        "baseline": lambda: DynamicCache(config=model.config),
        PEER: lambda: QuantizedCache(backend="hqq", config=model.config, nbits=4),
        **{
            name: (lambda codec=codec: FlashCodecCache.from_config(model.config, codec=codec))
            for name, codec in ((n, study_tier(n).codec) for n in args.tiers)
        },
    }
    nll: dict[str, list[np.ndarray]] = {name: [] for name in makers}
    kl: dict[str, list[np.ndarray]] = {name: [] for name in makers}
    copies = []
    started = time.perf_counter()
    for index, window in enumerate(windows):
        targets = torch.tensor(window[ctx:])
        base = None
        for name, make in makers.items():
            attention = study_tier(name).attention if name in args.tiers else "materialized"
            with attending_on(model, attention):
                lp = log_probs(model, make(), window, ctx)
            base = lp if base is None else base
            nll[name].append((-lp[torch.arange(len(targets)), targets]).numpy())
            kl[name].append((base.exp() * (base - lp)).sum(-1).clamp_min(0).numpy())
        copies.append(copy_positions(window, ctx))
        print(f"window {index + 1}/{len(windows)} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    copy = np.concatenate(copies)
    flat_nll = {name: np.concatenate(v).astype(np.float64) for name, v in nll.items()}
    flat_kl = {name: np.concatenate(v).astype(np.float64) for name, v in kl.items()}
    base_nll = flat_nll["baseline"]
    caches = {}
    for name in makers:
        if name == "baseline":
            continue
        dnll = flat_nll[name] - base_nll
        vs = None if name == PEER else flat_nll[name] - flat_nll[PEER]
        caches[name] = {
            subset: summary(flat_kl[name][mask], dnll[mask], None if vs is None else vs[mask])
            for subset, mask in (("all", np.ones_like(copy)), ("copy", copy), ("other", ~copy))
        }
        if name in args.tiers:
            caches[name]["attention"] = study_tier(name).attention
        caches[name]["ppl_delta"] = math.exp(flat_nll[name].mean()) - math.exp(base_nll.mean())
    out = {
        "what": __doc__.split("\n\n")[0],
        "how": "teacher-forced windows; a copy position's true token continues a bigram seen earlier in "
        "the window; dnll = NLL(cache) - NLL(baseline) of the true token, nats; dnll_vs_peer = "
        f"NLL(cache) - NLL({PEER}); intervals: 95% paired bootstrap over positions "
        f"({BOOTSTRAP_RESAMPLES} resamples, seeded)",
        "stamp": stamp(["flashcodec-kv", "kvbench", "torch", "transformers", "hqq"]),
        "model": {"path": str(path), "weights_sha256": weights_digest(path), "dtype": "bfloat16"},
        "settings": {**settings.as_dict(), "copy_share": float(copy.mean())},
        "baseline_perplexity": math.exp(base_nll.mean()),
        "caches": caches,
        "seconds": time.perf_counter() - started,
    }
    write_json(args.out, out)
    print(f"wrote {args.out}")
    for name, row in caches.items():
        a, c, o = row["all"], row["copy"], row["other"]
        print(
            f"{name:24s} KL {a['kl_mean']:.3e}  dppl {row['ppl_delta']:+.4f}  "
            f"dNLL copy {c['dnll']:+.5f} other {o['dnll']:+.5f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
