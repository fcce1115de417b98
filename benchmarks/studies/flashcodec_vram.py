"""Cache footprint, fill time and per-step read cost of CodecKVCache as the sequence grows.

Question: does the memoized read keep a decode step's cost flat as S grows, and what does each
tier hold in memory?

For each S (4k .. 64k tokens; B=1, H=8, D=64, fp32 as in the description) and tier of
:data:`flashcodec.tiers.TIERS` (``--tiers``; default jpeg-k2, jpeg-k2-int8, jpeg-k8-int8, png-keep1):

* storage: measured from the tensors the cache holds (``storage_bytes()``): ``held`` = used
  archive + raw tail (= kvspec ``nbytes``), ``allocated`` = archive capacity + tail buffers,
  ``view`` = the memoized reconstruction, and ``ratio`` = held / raw.
* fill: one ``forward`` of the whole sequence (min of ``--repeats``).
* step: ``decode_step`` of one new token, which appends it and returns the full view
  (median and mean over ``--steps`` steps after one warm-up step; the steps cross block
  boundaries, so they include the one-block decodes and any geometric regrowth).
* blocks decoded per step (keys + values): the work a step does, counted (the growth of each
  stream's ``view_blocks``, the blocks its memoized view holds decoded), so the flatness
  evidence does not depend on a quiet machine. A non-memoized read would decode all of them.
* redecode: what a non-memoized read would cost per step: decode every archived block
  (``codec.decode`` of the whole archive), min of ``--redecode-repeats`` (the min is the least
  disturbed estimate on a shared machine; the load average is recorded with the results).

The flatness claim is a ratio measured in one run: ``step_median(S) / step_median(S_min)`` and
``step_min(S) / step_min(S_min)`` stay near 1 (the min is the least noise-sensitive on a shared
machine), and the blocks decoded per step stay at most 2, while re-decoding grows with S.

    hatch run torch:python benchmarks/studies/flashcodec_vram.py   # writes results/flashcodec_vram.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashcodec"))  # common.py
from common import random_walk, stamp, tier_list
from common import study_tier as tier
from flashcodec import CodecKVCache
from kvbench.results import results_path, write_json

DEFAULT_TIERS = "jpeg-k2,jpeg-k2-int8,jpeg-k8-int8,png-keep1"


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def run_one(name: str, keys: torch.Tensor, values: torch.Tensor, new: torch.Tensor, args) -> dict:
    s, codec = keys.shape[2], tier(name).codec
    fills = []
    for _ in range(args.repeats):
        cache = CodecKVCache(codec=codec)
        t0 = time.perf_counter()
        cache.forward(keys, values)
        fills.append((time.perf_counter() - t0) * 1e3)
    st_fill = cache.storage_bytes()
    cache.decode_step(new[:, :, :1], new[:, :, :1])  # warm-up: first regrowth of the view
    # count the work too (blocks decoded per step): unlike wall time, a shared CPU cannot disturb it
    streams = (cache.keys, cache.values)
    steps, decoded = [], []
    for t in range(1, args.steps + 1):
        k1 = new[:, :, t : t + 1]
        before = sum(st.view_blocks for st in streams)
        t0 = time.perf_counter()
        cache.decode_step(k1, k1)
        steps.append((time.perf_counter() - t0) * 1e3)
        decoded.append(sum(st.view_blocks for st in streams) - before)
    stream = cache.keys
    redecode = timed(
        lambda: stream.codec.decode(stream.archived_parts(), stream.dtype), args.redecode_repeats
    )
    st = cache.storage_bytes()
    row = {
        "tier": name,
        "codec": codec.config(),
        "seq_len": s,
        "storage_after_fill": {
            "held_bytes": st_fill.held,
            "used_bytes": st_fill.used,
            "tail_bytes": st_fill.tail,
            "allocated_bytes": st_fill.allocated,
            "view_bytes": st_fill.view,
            "raw_bytes": st_fill.raw,
            "ratio": round(st_fill.ratio, 5),
        },
        "storage_after_steps": {
            "held_bytes": st.held,
            "allocated_bytes": st.allocated,
            "view_bytes": st.view,
        },
        "fill_ms_min": round(min(fills), 3),
        "step_ms_median": round(statistics.median(steps), 4),
        "step_ms_mean": round(statistics.fmean(steps), 4),
        "step_ms_max": round(max(steps), 4),
        "step_ms_min": round(min(steps), 4),
        "blocks_decoded_per_step_max": max(decoded),
        "blocks_decoded_per_step_mean": round(statistics.fmean(decoded), 4),
        "blocks_archived": stream.n_blocks,
        "redecode_ms_min": round(min(redecode), 3),
    }
    print(
        f"  {name:14s} S={s:6d} held {st_fill.held / 2**20:8.1f} MiB ratio {st_fill.ratio:.3f} "
        f"fill {row['fill_ms_min']:8.1f} ms step {row['step_ms_median']:.3f} ms "
        f"(mean {row['step_ms_mean']:.3f}) redecode {row['redecode_ms_min']:.2f} ms"
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redecode-repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--tiers", type=tier_list, default=tier_list(DEFAULT_TIERS), help="tier names, comma-separated"
    )
    parser.add_argument("--out", type=Path, default=results_path("flashcodec_vram.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    load_before = os.getloadavg()
    rows = []
    for s in args.seq:
        keys = random_walk(args.batch, args.heads, s, args.dim, seed=0, step=0.05)
        values = random_walk(args.batch, args.heads, s, args.dim, seed=1, step=0.05)
        new = random_walk(args.batch, args.heads, args.steps + 1, args.dim, seed=2, step=0.05)
        for name in args.tiers:
            rows.append(run_one(name, keys, values, new, args))
        del keys, values

    s_min = min(args.seq)
    flatness = {}
    for name in args.tiers:
        base = next(r for r in rows if r["tier"] == name and r["seq_len"] == s_min)
        flatness[name] = {
            str(r["seq_len"]): {
                "step_ratio": round(r["step_ms_median"] / base["step_ms_median"], 3),
                # the fastest step (no block completes): the least noise-sensitive per-step figure
                "step_min_ratio": round(r["step_ms_min"] / base["step_ms_min"], 3),
                "redecode_ratio": round(r["redecode_ms_min"] / base["redecode_ms_min"], 3),
                "seq_ratio": r["seq_len"] / s_min,
            }
            for r in rows
            if r["tier"] == name
        }
    out = {
        "benchmark": "flashcodec cache footprint, fill time and per-step read cost vs sequence length",
        **stamp(["flashcodec-kv", "kvcache-spec", "torch", "numpy"]),
        "shape": {"batch": args.batch, "heads": args.heads, "dim": args.dim, "dtype": "float32"},
        "method": {
            "fill": f"min of {args.repeats} CodecKVCache.forward calls on the whole sequence",
            "step": f"decode_step of one token (append + full view), {args.steps} steps after one warm-up",
            "redecode": f"codec.decode of every archived block of the keys stream, min of {args.redecode_repeats}",
            "storage": "measured from the tensors held (CodecStorage); keys + values",
        },
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
        "rows": rows,
        "flatness_vs_smallest_S": flatness,
    }
    print(f"wrote {write_json(args.out, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
