"""Bits per layer for the rotation code, keys against values, from the real model's sensitivity.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=1 \
        hatch run bench:python benchmarks/studies/palu_rotation_layers.py

The rotation tiers spend the same bits on every layer (keys 4, values 3 in ``rotation-3.5bit``).
This study asks how much KL that leaves on the table on SmolLM2-135M:

1. **Measure.** With every other layer uncompressed (mlx-lm's ``KVCache``), one layer's keys (or
   values) go through the rotation code at 3 bits, the other tensor at 8; the KL of the scored
   positions' next-token distributions from the uncompressed run is that tensor's cost.
2. **Spend.** Under the high-rate model each bit divides a tensor's cost by 4; a greedy reverse
   water-filling from 2 bits gives each (layer, tensor) an integer width for a given average.
3. **Check.** The allocated caches run kvbench's protocol beside the uniform tiers at the same
   average and mlx-lm's 4-bit cache (as ``real_model.py`` runs them: float32 compute, K/V rounded to
   bfloat16, resident bytes).

Results: ``benchmarks/results/palu_rotation_layers.json``, written after each step, so a stopped run
resumes where it was.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from kvbench.models import default_text_path
from kvbench.protocol import Settings, text_windows
from kvbench.results import environment_stamp, results_path, write_json
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from palu_mlx import KVCacheConfig
from palu_mlx.compare import load_model
from palu_mlx.models import model_kv_dims
from palu_mlx.rope import model_rotaries
from palu_mlx.rotation_code import RotationKVCache, rotation_code

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "palu"))
import real_model  # noqa: E402  (the protocol the check follows)

OUT = results_path("palu_rotation_layers.json")
#: what the measurements say, kept with them
NOTE = (
    "On SmolLM2 the rotation code's keys cost 2.6x its values at 3 bits (summed over layers), and the "
    "costliest tensor 28x the cheapest; widths spread by the measured costs at the same bytes give 0.80x "
    "(3 bits), 0.79x (3.5) and 0.73x (4) of the uniform tiers' KL. Not enough to pay for a per-model file "
    "(the targets were 0.05x mlx-lm q4's KL at its bytes and 0.25x at 0.6x its bytes); the uniform tiers "
    "stay, keys a bit above values."
)
#: the width a tensor is measured at, and the other tensor's meanwhile (near exact)
MEASURED_BITS, OTHER_BITS = 3, 8
#: the token counts of the measurement (``measure-*``: one window) and of the check (``windows`` of
#: ``context`` + ``scored`` tokens read ``step`` at a time), as kvbench's real-model protocol runs them
SIZES = {
    "measure-context": 512,
    "measure-scored": 64,
    "context": 2048,
    "scored": 256,
    "windows": 2,
    "step": 32,
}
#: averages the allocation is checked at, beside the uniform tier of the same average
AVERAGES = {3.0: (3, 3), 3.5: (4, 3), 4.0: (4, 4)}


def layer_caches(model: Any, widths: dict[int, tuple[int, int]], recent: int) -> list[Any]:
    """The rotation code at ``widths[layer] = (key bits, value bits)``; other layers uncompressed."""
    head_dim, heads = model_kv_dims(model)
    rotaries = model_rotaries(model, head_dim) or [None] * len(model.layers)
    config = KVCacheConfig(method="rotation", head_dim=head_dim, palu_recent_tokens=recent)
    return [
        RotationKVCache(
            config, rotation_code(heads, head_dim, widths[i][0]), rotation_code(heads, head_dim, widths[i][1]),
            rotaries[i],
        )
        if i in widths
        else KVCache()
        for i in range(len(model.layers))
    ]  # fmt: skip


def kl_of(base: np.ndarray, logp: np.ndarray) -> float:
    """Mean KL(base || logp) over positions (log-probabilities, float64)."""
    return float((np.exp(base) * (base - logp)).sum(axis=-1).mean())


def allocate(costs: np.ndarray, average: float, low: int = 2, high: int = 8) -> np.ndarray:
    """Integer widths minimising ``sum(costs * 4 ** (MEASURED_BITS - widths))`` at ``average`` bits."""
    widths = np.full(len(costs), low)
    for _ in range(int(round(average * len(costs))) - low * len(costs)):
        gain = costs * 4.0 ** (MEASURED_BITS - widths) * 0.75
        gain[widths >= high] = -1.0
        widths[int(np.argmax(gain))] += 1
    return widths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    for option, default in SIZES.items():
        parser.add_argument(f"--{option}", type=int, default=default)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    model, tokenizer, info = load_model(args.model, "bfloat16", "float32")
    tokens = tokenizer.encode(default_text_path().read_text(encoding="utf-8"), add_special_tokens=False)
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    setup = {"model": info["name"], **{k: v for k, v in vars(args).items() if k not in ("out", "model")}}
    if result.get("setup") != setup:
        result = {"setup": setup, "costs": {}, "rows": {}}

    def save() -> None:
        write_json(
            args.out,
            {
                **result,
                "note": NOTE,
                **environment_stamp(["palu-mlx", "kvbench", "mlx", "mlx-lm"]),
                "command": "python benchmarks/studies/palu_rotation_layers.py",
            },
        )

    # 1. one tensor of one layer at MEASURED_BITS, everything else exact: its KL is its cost
    (window,) = text_windows(
        tokens,
        Settings(
            windows=1, context_tokens=args.measure_context, scored_tokens=args.measure_scored, prompt_count=1
        ),
    )
    n_layers = len(model.layers)

    def measure(make: Callable[[], list[Any]]) -> np.ndarray:
        return real_model.run_window(model, make, window, args.measure_context, args.measure_scored)[0]

    exact = measure(lambda: [KVCache() for _ in model.layers])
    for layer in range(n_layers):
        for tensor, widths in (
            ("keys", (MEASURED_BITS, OTHER_BITS)),
            ("values", (OTHER_BITS, MEASURED_BITS)),
        ):
            name = f"{layer}.{tensor}"
            if name not in result["costs"]:
                logp = measure(lambda widths=widths, layer=layer: layer_caches(model, {layer: widths}, 0))
                result["costs"][name] = kl_of(exact, logp)
                print(f"{name}: KL {result['costs'][name]:.3g}", flush=True)
                save()
    costs = np.array([result["costs"][f"{i}.{t}"] for t in ("keys", "values") for i in range(n_layers)])

    # 2 and 3. the allocation at each average beside the uniform tier and mlx-lm q4, on the protocol
    windows = text_windows(
        tokens,
        Settings(
            windows=args.windows, context_tokens=args.context, scored_tokens=args.scored, prompt_count=1
        ),
    )
    makers: dict[str, tuple[Callable[[], list[Any]], dict]] = {
        "baseline": (lambda: [KVCache() for _ in model.layers], {}),
        "mlx-lm-q4": (lambda: [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers], {}),
    }
    for average, (key_bits, value_bits) in AVERAGES.items():
        uniform = {i: (key_bits, value_bits) for i in range(n_layers)}
        makers[f"uniform-k{key_bits}v{value_bits}"] = (
            lambda uniform=uniform: layer_caches(model, uniform, 32),
            {"widths": [key_bits, value_bits]},
        )
        spent = allocate(costs, average)
        widths = {i: (int(spent[i]), int(spent[n_layers + i])) for i in range(n_layers)}
        makers[f"allocated-{average:g}"] = (
            lambda widths=widths: layer_caches(model, widths, 32),
            {"widths": [list(w) for w in widths.values()]},
        )
    base = None
    for name, (make, record) in makers.items():
        done = [n for n in makers if n != "baseline" and n not in result["rows"]] == []
        if name in result["rows"] and (name != "baseline" or done):
            continue
        started = time.perf_counter()
        runs = [real_model.run_window(model, make, w, args.context, args.step) for w in windows]
        logp = np.concatenate([r[0] for r in runs])
        if name == "baseline":
            base = logp
        result["rows"][name] = {
            **record,
            "held_bytes": float(np.mean([r[1] for r in runs])),
            "kl": kl_of(base, logp),
            "top1": float((base.argmax(-1) == logp.argmax(-1)).mean()),
            "seconds": round(time.perf_counter() - started, 1),
        }
        q4 = result["rows"].get("mlx-lm-q4")
        if q4 is not None:
            for row in result["rows"].values():
                row["bytes_x_q4"] = row["held_bytes"] / q4["held_bytes"]
                row["kl_x_q4"] = row["kl"] / q4["kl"] if q4["kl"] else None
        print(name, {k: v for k, v in result["rows"][name].items() if k != "widths"}, flush=True)
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
