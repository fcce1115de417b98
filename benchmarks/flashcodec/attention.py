"""One layer's decode step: materialized view + SDPA vs coefficient-domain attention on the stored rows.

Question: what does attending on the stored rows cost and save, per sequence length, compared
with the materialized path that reads the memoized ``[B, H, S, D]`` view and runs SDPA?

Setup (the description's): B=1, H_kv=8, H_q=16 (GQA, G=2), D=64 (``--dim``), fp32, keys and values
a unit-RMS random walk along the sequence. For each final length S (``--seqs``, 4k .. 64k tokens)
and tier of :data:`flashcodec.tiers.TIERS` (``--tiers``; default jpeg-k2-int8, jpeg-k2, png-keep1:
both paths run on each tier's codec, whatever its own attention), a cache is
prefilled with ``S - steps - 1`` tokens and
then runs ``1 + steps`` decode steps (one warm-up), so it holds exactly S tokens at the end. One
decode step is, per path:

* ``materialized``: ``update_and_fetch(k, v)`` (append; the memoized read decodes only new blocks
  and copies the tail) then ``scaled_dot_product_attention`` over the view (GQA in SDPA);
* ``coefficient_torch``: ``append(k, v)`` then ``codec_decode_attention(..., backend="torch")``;
* ``coefficient_triton`` (CUDA only): the same with the Triton split-K kernel.

Timing: median and min over the measured steps (``time.perf_counter``; CUDA: synchronized).
Memory, per path:

* ``resident_bytes``: what the cache holds after the steps, measured from its tensors
  (``storage_bytes().resident`` = archive capacity + tail buffers + the memoized view, if any);
* ``transient_peak_bytes``: the high-water mark of tensors allocated during the measured steps and
  alive at once (CPU: :class:`flashcodec.peak_memory.PeakMemory`, an aten-level dispatch tracker; CUDA:
  ``torch.cuda.max_memory_allocated`` minus the bytes allocated before the steps);
* ``peak_bytes = resident_bytes + transient_peak_bytes``.

The prefill view a materialized cache builds is counted in ``resident_bytes``; the coefficient
paths never build it. ``max_abs_diff`` compares the last step's output of each coefficient path
with the materialized one (``max_rel_diff``: divided by the largest output), and
``max_rel_error_vs_fp64_truth`` each path's last output with attention computed in fp64 from the
same stored rows. Ratios (``time_ratio = coefficient / materialized``,
``peak_ratio = materialized / coefficient``) are measured side by side in one run.

    hatch run torch:python benchmarks/flashcodec/attention.py              # CPU: results/flashcodec_attention.json
    python benchmarks/flashcodec/attention.py --device cuda --dim 128      # GPU: results/flashcodec_attention_cuda.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import add_device_options, save, stamp, sync, tier_list
from common import study_tier as TIER
from flashcodec import CodecKVCache
from flashcodec.attention import codec_decode_attention, triton_available
from flashcodec.peak_memory import PeakMemory

DEFAULT_TIERS = "jpeg-k2-int8,jpeg-k2,png-keep1"


def unit_walk(h: int, s: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """``[1, h, s, d]`` fp32 random walk along the sequence, each token scaled to RMS 1."""
    x = torch.randn(1, h, 1, d, generator=gen) + 0.1 * torch.randn(1, h, s, d, generator=gen).cumsum(2)
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def fp64_truth(query: torch.Tensor, cache: CodecKVCache) -> torch.Tensor:
    """The last step's attention in fp64 over the fp64 decode of the same stored rows (+ the raw
    tail): the reference both paths approximate."""
    k, v = (
        torch.cat([cache.codec.decode(st.archived_parts(), torch.float64), st.tail().double()], 2)
        for st in (cache.keys, cache.values)
    )
    return torch.nn.functional.scaled_dot_product_attention(query.double(), k, v, enable_gqa=True)


def make_step(path: str, cache: CodecKVCache):
    """The decode step of one path: ``step(q [1, Hq, 1, D], k, v [1, H, 1, D]) -> out [1, Hq, 1, D]``."""
    if path == "materialized":

        def step(q, k, v):
            keys, values = cache.update_and_fetch(k, v)
            return torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    else:
        backend = "torch" if path == "coefficient_torch" else "triton"

        def step(q, k, v):
            cache.append(k, v)
            return codec_decode_attention(q, cache.keys, cache.values, backend=backend)

    return step


def run_path(path: str, tier: str, prefill: tuple, tokens: list, device: torch.device) -> dict:
    cache = CodecKVCache(codec=TIER(tier).codec)
    cache.append(*prefill)
    if path == "materialized":
        cache.read()  # what the prefill leaves behind in a transformers run: the view
    step = make_step(path, cache)
    q, k, v = tokens[0]
    step(q, k, v)  # warm-up (and the Triton compile on CUDA)
    measured = tokens[1:]
    times = []
    out = None
    # memory and timing in separate passes (the tracker slows the ops down); both on the same steps
    half = len(measured) // 2
    for q, k, v in measured[:half]:
        sync(device)
        t0 = time.perf_counter()
        out = step(q, k, v)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        for q, k, v in measured[half:]:
            out = step(q, k, v)
        sync(device)
        transient = torch.cuda.max_memory_allocated(device) - before
        how = "torch.cuda.max_memory_allocated - memory_allocated before the steps"
    else:
        with PeakMemory() as tracker:
            for q, k, v in measured[half:]:
                out = step(q, k, v)
        transient = tracker.peak
        how = "PeakMemory (aten dispatch tracker) over the steps"
    storage = cache.storage_bytes()
    return {
        "step_ms_median": statistics.median(times),
        "step_ms_min": min(times),
        "timed_steps": len(times),
        "resident_bytes": storage.resident,
        "archive_bytes": storage.held,
        "view_bytes": storage.view,
        "transient_peak_bytes": transient,
        "peak_bytes": storage.resident + transient,
        "memory_measured_with": how,
        "seq_len_end": cache.offset,
        "_out": out,
        "_cache": cache,
    }


def run(args) -> dict:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    paths = ["materialized", "coefficient_torch"]
    triton_note = None
    if device.type == "cuda" and triton_available():
        paths.append("coefficient_triton")
    else:
        triton_note = "not run: the Triton kernel is measured on CUDA only (no GPU here)"
    rows = []
    h, g, d = args.heads, args.groups, args.dim
    for seq in args.seqs:
        gen = torch.Generator().manual_seed(seq)
        total_steps = 1 + args.steps
        keys, values = unit_walk(h, seq, d, gen), unit_walk(h, seq, d, gen)
        start = seq - total_steps
        prefill = (keys[:, :, :start].to(device), values[:, :, :start].to(device))
        tokens = [
            (
                torch.randn(1, h * g, 1, d, generator=gen).to(device),
                keys[:, :, t : t + 1].to(device),
                values[:, :, t : t + 1].to(device),
            )
            for t in range(start, seq)
        ]
        for name in args.tiers:
            result = {"seq_len": seq, "tier": name, "codec": TIER(name).codec.config()}
            for path in paths:
                result[path] = run_path(path, name, prefill, tokens, device)
            ref = result["materialized"].pop("_out")
            truth = fp64_truth(tokens[-1][0], result["materialized"]["_cache"])
            for path in paths:
                cache = result[path].pop("_cache")
                result[path]["max_rel_error_vs_fp64_truth"] = float(
                    (result[path].get("_out", ref).double() - truth).abs().max() / truth.abs().max()
                )
                del cache
            for path in paths[1:]:
                out = result[path].pop("_out")
                result[path]["max_abs_diff_vs_materialized"] = float((out - ref).abs().max())
                result[path]["max_rel_diff_vs_materialized"] = float(
                    (out - ref).abs().max() / ref.abs().max()
                )
                result[path]["time_ratio_vs_materialized"] = (
                    result[path]["step_ms_median"] / result["materialized"]["step_ms_median"]
                )
                result[path]["peak_ratio_materialized_over_this"] = (
                    result["materialized"]["peak_bytes"] / result[path]["peak_bytes"]
                )
            if triton_note:
                result["coefficient_triton"] = triton_note
            rows.append(result)
            print(summary_line(result), flush=True)
    return {
        "benchmark": "flashcodec/attention",
        "question": "one decode step: materialized view + SDPA vs attention on the stored rows",
        "settings": {
            "batch": 1,
            "kv_heads": h,
            "query_heads": h * g,
            "head_dim": d,
            "dtype": "float32",
            "measured_steps": args.steps,
            "signal": "unit-RMS random walk (step 0.1) along the sequence",
        },
        **stamp(["torch", "triton", "flashcodec-kv", "kvcache-spec"], device),
        "results": rows,
    }


def summary_line(r: dict) -> str:
    mat, coef = r["materialized"], r["coefficient_torch"]
    line = (
        f"S={r['seq_len']:>6} {r['tier']:<14} materialized {mat['step_ms_median']:8.2f} ms / {mat['peak_bytes'] / 2**20:7.1f} MiB"
        f" | coefficient(torch) {coef['step_ms_median']:8.2f} ms / {coef['peak_bytes'] / 2**20:7.1f} MiB"
        f" (time x{coef['time_ratio_vs_materialized']:.2f}, peak /{coef['peak_ratio_materialized_over_this']:.1f},"
        f" rel err vs fp64: mat {mat['max_rel_error_vs_fp64_truth']:.1e}, coef {coef['max_rel_error_vs_fp64_truth']:.1e})"
    )
    tri = r.get("coefficient_triton")
    if isinstance(tri, dict):
        line += f" | triton {tri['step_ms_median']:.3f} ms / {tri['peak_bytes'] / 2**20:.1f} MiB"
    return line


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192, 16384, 32768, 65536]
    )
    parser.add_argument(
        "--tiers", type=tier_list, default=tier_list(DEFAULT_TIERS), help="tier names, comma-separated"
    )
    parser.add_argument(
        "--steps", type=int, default=24, help="measured decode steps (half timed, half tracked)"
    )
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    add_device_options(parser)
    args = parser.parse_args(argv)
    save(run(args), "flashcodec_attention", args)


if __name__ == "__main__":
    main()
