"""Where a palu cache's bytes go on the real model: codes, per-token scales, basis, sinks, recent rows.

    hatch run bench:python benchmarks/studies/palu_byte_breakdown.py \\
        --sensitivity ~/.cache/kvbench/models/smollm2-135m.palu-sensitivity.json
    hatch run bench:python benchmarks/studies/palu_byte_breakdown.py --only palu-2.25bit-scaled+rel

Writes ``benchmarks/results/palu_byte_breakdown.json``. On Linux preload OpenBLAS
(``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3``).

The protocol is ``benchmarks/palu/real_model.py``'s, on its first window (``--context`` tokens
prefilled in one call, then ``--scored`` tokens read in steps of ``--step``), and its candidates
(same names, same configurations): before each step every array a cache holds is sorted into
one part, and each part's bytes are averaged over the steps, so the parts add up to the
``held_bytes`` real_model.py measures (the script checks that they do). The parts:

* ``codes``: the packed code bits of the tokens held (``row_padding``: of those, the bits that
  only round a row up to whole bytes);
* ``token_scales``: the per-token, per-head scale in front of each row;
* ``capacity``: buffer rows grown but not yet written (every buffer grows in steps of 256 tokens,
  as mlx-lm's own caches do);
* ``basis``, ``mean``, ``singular_values``, ``steps``, ``rope``: the per-sequence projection, its
  mean, its singular values, the quantizer steps and the RoPE frequencies;
* ``sinks``, ``recent``: the first tokens and the newest tokens held as given;
* ``exact``: tokens held as given before a layer fitted (none at these lengths);
* ``other``: anything the script does not recognise (it should be 0).

Each part is also given over mlx-lm ``QuantizedKVCache(bits=4, group_size=64)``'s held bytes in
the same run (its own parts: codes, scales and biases, capacity), and each palu layer's kept
basis columns and the columns of its fit whose water-filled width was 0 (dropped: never stored).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from kvbench.models import default_text_path
from kvbench.protocol import Settings, text_windows
from kvbench.results import environment_stamp, results_path, write_json
from palu_mlx.cache import PaluKVCache
from palu_mlx.coders.fixed import FixedQuantCoder
from palu_mlx.compare import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "palu"))
import real_model  # noqa: E402  (the candidates and protocol this breakdown follows)

OUT = results_path("palu_byte_breakdown.json")
#: the tiers the real-model results quote around half of q4's bytes, and q4 itself
DEFAULT = (
    "mlx-lm-q4",
    "palu-2.25bit-scaled+rel",
    "palu-2bit-scaled+rel",
    "palu-1.75bit-scaled+sens",
    "palu-1.5bit-scaled+sens",
    "palu-1.25bit-scaled+sens",
)


def palu_parts(cache: PaluKVCache) -> dict[str, int]:
    """Bytes of every array ``cache`` holds, by part (they sum to ``cache.nbytes``)."""
    parts: dict[str, int] = defaultdict(int)
    n = cache.offset
    for prefix, proj, coder, codes in cache._tensors():
        exact = cache._exact_keys if prefix == "key" else cache._exact_values
        if exact is not None:
            parts["exact"] += exact.nbytes
        if proj is None:
            continue
        if not cache.source.per_model:
            for name, arr in proj.arrays().items():
                part = "basis" if name == "basis_scale" else name  # an 8-bit basis' column scales
                parts[part if part in ("basis", "mean", "singular_values") else "other"] += arr.nbytes
            for name, arr in coder.constants().items():
                parts["steps" if name == "steps" else "other"] += arr.nbytes
        for name, buf in (codes or {}).items():
            b, h, cap, width = buf.shape
            item = buf.dtype.size
            parts["capacity"] += b * h * (cap - n) * width * item
            written = b * h * n * width * item
            if isinstance(coder, FixedQuantCoder) and name == "codes":
                scale = b * h * n * (coder.scale_bytes if coder.token_scale else 0)
                parts["token_scales"] += scale
                parts["codes"] += written - scale
                parts["row_padding"] += b * h * n * (8 * coder.code_bytes - coder.bits_per_row) / 8
            else:
                parts["codes"] += written
    if cache.rotary is not None and cache._shape is not None and not cache.source.per_model:
        parts["rope"] += cache.rotary.inv_freq.nbytes
    if cache._key_proj is not None:
        parts["sinks"] += sum(a.nbytes for a in cache._sinks.arrays())
        parts["recent"] += sum(a.nbytes for a in cache._recent.arrays())
    total = int(cache.nbytes)
    counted = sum(v for k, v in parts.items() if k != "row_padding")
    parts["other"] += total - counted
    return dict(parts)


def q4_parts(cache: Any) -> dict[str, int]:
    """mlx-lm ``QuantizedKVCache``'s bytes: packed codes, scales and biases, unwritten capacity."""
    parts: dict[str, int] = defaultdict(int)
    if cache.keys is None:
        return dict(parts)
    n = cache.offset
    for tensors in (cache.keys, cache.values):
        for i, arr in enumerate(tensors):
            cap = arr.shape[2]
            written = arr.nbytes * n // cap
            parts["codes" if i == 0 else "scales_biases"] += written
            parts["capacity"] += arr.nbytes - written
    parts["other"] += int(cache.nbytes) - sum(parts.values())
    return dict(parts)


def layer_columns(caches: list[Any]) -> list[dict[str, Any]]:
    """Per palu layer: basis columns kept for keys and values, their code bits per row, and the
    fit's columns dropped at width 0 (never stored)."""
    out = []
    for c in caches:
        if not isinstance(c, PaluKVCache) or c._key_proj is None:
            continue
        row = {}
        for prefix, proj, coder, _ in c._tensors():
            d = c._shape[2] if prefix == "key" else c._shape[3]
            cols = proj.rank
            bits = getattr(coder, "bits_per_row", None)
            zero_width = sum(1 for w in (coder.fixed_widths or ()) if w == 0)
            row[prefix] = {
                "columns_kept": cols,
                "columns_dropped": d - cols,
                "kept_columns_with_0_bits": zero_width,
                "code_bits_per_row": bits,
            }
        out.append(row)
    return out


def breakdown(model: Any, make, window: list[int], context: int, step: int) -> dict[str, Any]:
    """Mean bytes by part over the steps of one window, and the layers' columns at the end."""
    caches = make()
    mx.eval(model(mx.array(window[:context])[None], cache=caches))
    sums: dict[str, float] = defaultdict(float)
    steps = 0
    held = []
    for start in range(context, len(window) - 1, step):
        for c in caches:
            for k, v in (palu_parts(c) if isinstance(c, PaluKVCache) else q4_parts(c)).items():
                sums[k] += v
        held.append(sum(int(c.nbytes) for c in caches))
        steps += 1
        chunk = window[start : min(start + step, len(window) - 1)]
        mx.eval(model(mx.array(chunk)[None], cache=caches))
    parts = {k: v / steps for k, v in sums.items()}
    return {"parts": parts, "held_bytes": float(np.mean(held)), "layers": layer_columns(caches)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    real_model.add_protocol_arguments(parser)
    parser.add_argument(
        "--only", default=",".join(DEFAULT), help="comma-separated candidates (real_model.py's)"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    model, tokenizer, info = load_model(args.model, "bfloat16", "float32")
    text = default_text_path().read_text(encoding="utf-8")
    tokens = tokenizer.encode(text, add_special_tokens=False)
    settings = Settings(windows=1, context_tokens=args.context, scored_tokens=args.scored, prompt_count=1)
    window = text_windows(tokens, settings)[0]
    cands = real_model.candidates(model, args.calibration, args.sensitivity)
    wanted = list(dict.fromkeys(["mlx-lm-q4", *args.only.split(",")]))
    unknown = [n for n in wanted if n not in cands]
    if unknown:
        parser.error(f"--only: unknown candidates {unknown}; known: {', '.join(cands)}")
    setup = {
        "model": info,
        "text": default_text_path().name,
        "windows": 1,
        "context_tokens": args.context,
        "scored_tokens": args.scored,
        "step_tokens": args.step,
    }
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    if result.get("setup") != setup:
        result = {"setup": setup, "rows": {}}
    for name in wanted:
        make, config = cands[name]
        row = breakdown(model, make, window, args.context, args.step)
        total = sum(v for k, v in row["parts"].items() if k != "row_padding")
        if abs(total - row["held_bytes"]) > 0.5:
            raise SystemExit(f"{name}: parts sum to {total}, but the caches hold {row['held_bytes']}")
        row["config"] = json.loads(json.dumps(config))
        result["rows"][name] = row
        q4 = result["rows"].get("mlx-lm-q4")
        for r in result["rows"].values():
            r["x_q4"] = None if q4 is None else {k: v / q4["held_bytes"] for k, v in r["parts"].items()}
            r["bytes_x_q4"] = None if q4 is None else r["held_bytes"] / q4["held_bytes"]
        result.update(environment_stamp(["palu-mlx", "kvbench", "mlx", "mlx-lm"]))
        result["command"] = " ".join(
            ["python benchmarks/studies/palu_byte_breakdown.py", *(argv or sys.argv[1:])]
        )
        write_json(args.out, result)
        shown = {k: round(v, 4) for k, v in (row["x_q4"] or {}).items()}
        print(json.dumps({"name": name, "bytes_x_q4": row["bytes_x_q4"], "x_q4": shown}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
