"""End-to-end greedy decode on the embedded model with a long prompt: baseline vs flashcodec tiers.

Question: what do the materialized and the materialization-free paths cost in decode speed and
memory on a whole model?

Configurations: ``baseline`` (transformers' ``DynamicCache``, raw K/V) and the tiers (or study
configurations) named by ``--tiers``, each with the attentions ``--attention`` asks for (default
both). A tier runs :class:`flashcodec.hf.FlashCodecCache` with its codec; with attention on the
codes it also runs inside :func:`flashcodec.hf.attending_on`: decode steps attend on the stored rows
and the prefill's view is released (backend ``auto``: torch on the CPU, the Triton kernel on CUDA).
Both attentions store the same codes, so the two runs of a tier are compared.

The prompt is the first ``--prompt-tokens`` tokens of kvbench's held-out text
(:func:`kvbench.models.default_text_path`); the decode is ``--new-tokens`` greedy steps written
out as the loop ``generate`` runs (one forward per token, argmax), so prefill and decode are
timed apart. The timed runs go round robin over every configuration (``--repeats`` rounds), so a
change in the machine's load hits all alike.

Figures per run:

* ``decode_tokens_per_s``: decode steps / decode-loop seconds of the fastest round (every
  round's seconds are in ``decode_s_all_runs``);
* ``peak_bytes``: high-water mark of tensors allocated during prefill + decode and alive at once
  (weights excluded). CPU: :class:`flashcodec.peak_memory.PeakMemory` (aten dispatch tracker), in
  a separate pass from the timing; CUDA: ``torch.cuda.max_memory_allocated`` minus the bytes
  before the run;
* ``decode_peak_bytes``: the most memory the decode steps use, the cache included: what the cache
  holds when decoding starts (resident, the view included) plus the high-water mark of tensors
  allocated during the decode steps (CPU, another separate pass); CUDA: the decode steps'
  ``max_memory_allocated`` minus the bytes before the prefill;
* ``steady_bytes``: bytes the cache holds after the decode, measured from its tensors (baseline:
  the ``DynamicCache`` keys and values; codec: ``storage_bytes().resident`` = archive capacity +
  tail buffers + the memoized view, if any);
* ``token_match_vs_baseline``; with attention on the codes ``tokens_equal_materialized`` and the
  ratios to the same tier's materialized run;
* ``decode_steps_on_stored_rows`` / ``fallbacks`` (attention on the codes): the wrapper's counters over
  every run of the tier (the timed repeats and the memory pass), per layer call.

    hatch run torch:python benchmarks/flashcodec/e2e.py          # writes results/flashcodec_e2e.json
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch
from common import (
    ATTENTION_OPTIONS,
    add_device_options,
    attention_list,
    save,
    stamp,
    study_tier,
    sync,
    tier_list,
)
from flashcodec.hf import FlashCodecCache, attending_on
from flashcodec.peak_memory import PeakMemory
from kvbench.models import default_text_path, embedded_model_path
from kvbench.results import weights_digest
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

DEFAULT_TIERS = "jpeg-k2-int8,jpeg-k8-int8,png-keep1,jpeg-k8-int4z-w64,jpeg-k8-int4z-w96i8,chan64-int4-w64i8"


def run_key(name: str, attention: str) -> str:
    """A run's key in the results: the tier's name and its attention."""
    return f"{name} ({attention})"


def cache_bytes(cache) -> int:
    """Bytes the cache holds, measured from its tensors."""
    if isinstance(cache, FlashCodecCache):
        return cache.storage_bytes().resident + cache.native_nbytes()
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


@torch.no_grad()
def greedy(
    model, ids: torch.Tensor, cache, new_tokens: int, during_decode=contextlib.nullcontext
) -> tuple[list[int], float, float]:
    """Prefill then ``new_tokens - 1`` decode steps inside ``during_decode(cache)``; returns
    (tokens, prefill s, decode s)."""
    device = ids.device
    sync(device)
    t0 = time.perf_counter()
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits  # as generate does
    token = logits[:, -1:].argmax(-1)
    sync(device)
    t1 = time.perf_counter()
    tokens = [int(token)]
    with during_decode(cache):
        for _ in range(new_tokens - 1):
            logits = model(token, cache=cache, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            tokens.append(int(token))
        sync(device)
    return tokens, t1 - t0, time.perf_counter() - t1


class Run:
    """One configuration: ``baseline`` (``DynamicCache``) or a tier with one attention."""

    def __init__(self, name: str, attention: str = "materialized"):
        self.tier = None if name == "baseline" else study_tier(name, attention)
        self.attention = attention
        self.name = name if self.tier is None else run_key(name, attention)
        self.decode_s: list[float] = []
        self.result: dict = {}
        self.coded_calls = 0  # the wrapper's counters, summed over every run of this configuration
        self.fallbacks: dict[str, int] = {}

    def new_cache(self, model):
        if self.tier is None:
            return DynamicCache(config=model.config)
        return FlashCodecCache.from_config(model.config, codec=self.tier.codec)

    def __call__(self, model, ids, new_tokens, backend, during_decode=contextlib.nullcontext):
        """One greedy run: returns (tokens, prefill s, decode s, steady bytes)."""
        with attending_on(model, self.attention, backend=backend) as stats:
            try:
                cache = self.new_cache(model)
                tokens, prefill_s, decode_s = greedy(model, ids, cache, new_tokens, during_decode)
                return tokens, prefill_s, decode_s, cache_bytes(cache)
            finally:
                if stats is not None:
                    self.coded_calls += stats.coded
                    for reason, n in stats.fallbacks.items():
                        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + n


def measure_memory(run: Run, model, ids, new_tokens, backend, device) -> int:
    """Peak bytes allocated during one prefill + decode (a pass apart from the timing)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run(model, ids, new_tokens, backend)
        return torch.cuda.max_memory_allocated(device) - before
    with PeakMemory() as tracker:
        run(model, ids, new_tokens, backend)
    return tracker.peak


def measure_decode_memory(run: Run, model, ids, new_tokens, backend, device) -> int:
    """Peak bytes during the decode steps, the cache included (another pass)."""
    peak = 0
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    @contextlib.contextmanager
    def during_decode(cache):
        nonlocal peak
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            yield
            peak = torch.cuda.max_memory_allocated(device) - before
            return
        held = cache_bytes(cache)
        with PeakMemory() as tracker:
            yield
        peak = held + tracker.peak

    run(model, ids, new_tokens, backend, during_decode)
    return peak


def run(args) -> dict:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else embedded_model_path()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = (
        tokenizer(default_text_path().read_text(encoding="utf-8"), return_tensors="pt")
        .input_ids[:, : args.prompt_tokens]
        .to(device)
    )
    runs = [Run("baseline")] + [
        Run(name, attention) for name in args.tiers for attention in attention_list(name, args.attention)
    ]
    # timing: round robin, so a change in the machine's load hits every configuration alike
    for _ in range(args.repeats):
        for r in runs:
            tokens, prefill_s, decode_s, steady = r(model, ids, args.new_tokens, args.backend)
            if not r.decode_s or decode_s < min(r.decode_s):
                r.result.update(tokens=tokens, prefill_s=prefill_s, steady_bytes=steady)
            r.decode_s.append(decode_s)
    rows = {}
    for r in runs:
        best = min(r.decode_s)
        r.result.update(
            decode_tokens_per_s=(args.new_tokens - 1) / best,
            decode_ms_per_token=best * 1e3 / (args.new_tokens - 1),
            decode_s_all_runs=r.decode_s,
            peak_bytes=measure_memory(r, model, ids, args.new_tokens, args.backend, device),
            decode_peak_bytes=measure_decode_memory(r, model, ids, args.new_tokens, args.backend, device),
        )
        rows[r.name] = r.result
    base_tokens = rows["baseline"]["tokens"]
    for r in runs[1:]:
        row = rows[r.name]
        row.update(tier=r.tier.name, attention=r.attention, codec=r.tier.codec.config())
        row["token_match_vs_baseline"] = sum(
            a == b for a, b in zip(row["tokens"], base_tokens, strict=True)
        ) / len(base_tokens)
        if r.attention != "codes":
            continue
        row["decode_steps_on_stored_rows"] = r.coded_calls
        row["fallbacks"] = dict(r.fallbacks)
        twin = rows.get(run_key(r.tier.name, "materialized"))  # the same codec, materialized
        if twin is not None:
            row["tokens_equal_materialized"] = row["tokens"] == twin["tokens"]
            row["speed_ratio_vs_materialized"] = row["decode_tokens_per_s"] / twin["decode_tokens_per_s"]
            row["steady_ratio_materialized_over_this"] = twin["steady_bytes"] / row["steady_bytes"]
            row["peak_ratio_materialized_over_this"] = twin["peak_bytes"] / row["peak_bytes"]
            row["decode_peak_ratio_this_over_materialized"] = (
                row["decode_peak_bytes"] / twin["decode_peak_bytes"]
            )
        row["decode_speed_ratio_vs_baseline"] = (
            row["decode_tokens_per_s"] / rows["baseline"]["decode_tokens_per_s"]
        )
    for name, row in rows.items():
        print(line(name, row), flush=True)
    cfg = model.config
    return {
        "benchmark": "flashcodec/e2e",
        "question": "greedy decode on a whole model: baseline vs tiers attending on a decoded view or on their codes",
        "settings": {
            "model": str(path.name),
            "weights_sha256": weights_digest(path),
            "layers": cfg.num_hidden_layers,
            "kv_heads": cfg.num_key_value_heads,
            "query_heads": cfg.num_attention_heads,
            "head_dim": getattr(cfg, "head_dim", None),
            "dtype": args.dtype,
            "prompt_tokens": int(ids.shape[1]),
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "backend": args.backend,
        },
        **stamp(["torch", "transformers", "triton", "flashcodec-kv", "kvcache-spec"], device),
        "results": rows,
    }


def line(name: str, r: dict) -> str:
    return (
        f"{name:<44} {r['decode_tokens_per_s']:8.1f} tok/s  peak {r['peak_bytes'] / 2**20:7.2f} MiB"
        f"  decode peak {r['decode_peak_bytes'] / 2**20:7.2f} MiB  steady {r['steady_bytes'] / 2**20:7.2f} MiB"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the embedded model)")
    parser.add_argument(
        "--tiers", type=tier_list, default=tier_list(DEFAULT_TIERS), help="tier names, comma-separated"
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_OPTIONS,
        default="both",
        help="both (default): each tier on a decoded view and on its codes; tier: each with its own",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=2015, help="default: 2,048 tokens after the decode"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    add_device_options(parser)
    args = parser.parse_args(argv)
    save(run(args), "flashcodec_e2e", args)


if __name__ == "__main__":
    main()
