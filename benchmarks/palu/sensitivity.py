"""Per-layer sensitivity of the real model to palu's coding, keys against values.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        hatch run bench:python benchmarks/palu/sensitivity.py            # writes the profile too

With every other layer exact, one layer's keys (or values) are coded at ``--bits`` code bits per
element by the prefill-fitted coder (:func:`palu_mlx.budgets.code_tensor`: a full-rank projection
per KV head, water-filled widths, fixed quantizers with a per-token scale, the first 4 tokens
exact, keys before RoPE) and the KL divergence of the next-token distributions of the last
``--scored`` positions from the exact run's is recorded (:func:`palu_mlx.budgets.measure_sensitivity`).
The text is palu's calibration text (``palu_mlx/data/calibration.txt``), never kvbench's
held-out text the tiers are scored on, so the profile is not fitted to the evaluation.

Writes ``benchmarks/results/palu_sensitivity.json`` (per layer: KL and squared error for keys
and values, the weight ``kl / error``, and the bits :meth:`SensitivityProfile.allocate` gives
each layer at 2, 2.5 and 3 bits) and the profile beside the model
(:func:`palu_mlx.budgets.profile_path`, or ``--profile``), which the ``+sens`` tiers read (``real_model.py --sensitivity``). The model
computes in float32 with its keys and values rounded to bfloat16 (what a bfloat16 model caches).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
from kvbench.models import resolve_model
from kvbench.protocol import Settings, text_windows
from kvbench.results import environment_stamp, results_path, write_json
from palu_mlx.budgets import SensitivityProfile, measure_sensitivity, profile_path
from palu_mlx.calibration.fit import default_calibration_text
from palu_mlx.compare import load_model

OUT = results_path("palu_sensitivity.json")
#: the averages whose per-layer split the results file shows
PREVIEW_BITS = (2.0, 2.5, 3.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bits", type=float, default=2.0, help="code bits per element of the probed tensor")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--scored", type=int, default=64)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--profile", type=Path, default=None, help="where to write the profile")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="measure nothing: rewrite --out's summary and layers from the profile already written",
    )
    args = parser.parse_args(argv)
    target = args.profile or profile_path(resolve_model(args.model))
    if args.summarize:
        result = json.loads(args.out.read_text())
        result.update(summarize(SensitivityProfile.load(target), result["summary"]["seconds"]))
        write_json(args.out, result)
        print(json.dumps(result["summary"]["relative_error_proxy"]))
        return 0

    model, tokenizer, info = load_model(args.model, "bfloat16", "float32")
    text = default_calibration_text()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    settings = Settings(
        windows=args.windows, context_tokens=args.context, scored_tokens=args.scored, prompt_count=1
    )
    windows = text_windows(tokens, settings)
    started = time.perf_counter()
    profile = measure_sensitivity(
        model, windows, args.scored, args.bits, progress=lambda line: print(line, flush=True)
    )
    seconds = time.perf_counter() - started
    profile.save(target)
    result = {
        "setup": {
            "model": info,
            "text": "palu_mlx/data/calibration.txt",
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "windows": args.windows,
            "context_tokens": args.context,
            "scored_tokens": args.scored,
            "bits": args.bits,
            "sink_tokens": 4,
        },
        **summarize(profile, seconds),
        "profile_file": Path(target).name,
        **environment_stamp(["palu-mlx", "kvbench", "mlx", "mlx-lm"]),
        "command": " ".join(["python benchmarks/palu/sensitivity.py", *(argv or sys.argv[1:])]),
    }
    write_json(args.out, result)
    print(f"wrote {args.out} and {target} ({seconds:.0f} s)")
    return 0


def summarize(profile: SensitivityProfile, seconds: float) -> dict:
    """The results file's ``summary`` and ``layers`` from a profile."""
    wk, wv = profile.weights()
    allocations = {f"{b:g}": [c.bits for c in profile.allocate(b)] for b in PREVIEW_BITS}
    layers = [
        {
            "layer": i,
            "key_kl": profile.key_kl[i],
            "value_kl": profile.value_kl[i],
            "key_error": profile.key_error[i],
            "value_error": profile.value_error[i],
            "key_weight": float(wk[i]),
            "value_weight": float(wv[i]),
            **{f"bits_at_{b}": allocations[b][i] for b in allocations},
        }
        for i in range(profile.n_layers)
    ]
    kl = np.array([profile.key_kl, profile.value_kl])
    # the prefill-computable proxy (WaterFilling.relative): a tensor's weight as 1 / its energy
    energy = np.array([[sum(v) for v in profile.key_variances], [sum(v) for v in profile.value_variances]])
    weights = np.array([wk, wv])
    return {
        "summary": {
            "key_kl_sum": float(kl[0].sum()),
            "value_kl_sum": float(kl[1].sum()),
            "most_sensitive": sorted(
                (
                    (float(kl[w, i]), f"layer {i} {'keys' if w == 0 else 'values'}")
                    for w in (0, 1)
                    for i in range(kl.shape[1])
                ),
                reverse=True,
            )[:8],
            "relative_error_proxy": {
                "corr_log_weight_vs_log_inverse_energy": float(
                    np.corrcoef(np.log(weights).ravel(), -np.log(energy).ravel())[0, 1]
                ),
                "corr_log_key_over_value_weight_vs_log_value_over_key_energy": float(
                    np.corrcoef(np.log(wk / wv), np.log(energy[1] / energy[0]))[0, 1]
                ),
                "weight_spread_max_over_min": float(weights.max() / weights.min()),
                "relative_weight_spread_max_over_min": float(
                    (weights * energy).max() / (weights * energy).min()
                ),
            },
            "seconds": round(seconds, 1),
        },
        "layers": layers,
    }


if __name__ == "__main__":
    sys.exit(main())
