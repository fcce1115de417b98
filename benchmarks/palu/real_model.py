"""palu-mlx's tiers on the real model beside mlx-lm's quantized caches: KL, top-1, bytes held.

    hatch run bench:python benchmarks/palu/real_model.py                       # every candidate
    hatch run bench:python benchmarks/palu/real_model.py --only palu-2.5bit-scaled   # one, resumable
    hatch run bench:python benchmarks/palu/real_model.py --context 1024 --out /tmp/scout.json
    hatch run bench:python benchmarks/palu/real_model.py --sensitivity PROFILE --only palu-2.5bit-scaled+sens

Writes ``benchmarks/results/palu_real_model.json``. On Linux preload OpenBLAS
(``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3``): the model computes in
float32 and its keys and values are rounded to bfloat16 before they are cached
(``palu_mlx.compare.load_model(..., compute_dtype="float32")``), so every cache holds what a
bfloat16 model caches.

The protocol (a lighter cousin of kvbench's, which decodes the scored tokens one at a time):

* the model is kvbench's named real model (``smollm2-135m``, SmolLM2-135M-Instruct) unless
  ``--model`` says otherwise; the text is kvbench's held-out text, which no calibration here
  has seen; ``--windows`` windows of ``--context`` tokens of context plus ``--scored`` scored
  tokens, spread over the text as kvbench spreads them;
* each candidate prefills the context in one call, then reads the scored tokens teacher-forced
  in steps of ``--step`` tokens; every scored position's next-token distribution is compared
  with the uncompressed cache's (``KVCache``, same run): KL divergence (nats) and top-1
  agreement, and each position's negative log-likelihood gives perplexity;
* ``float32-kv``, the noise floor: the uncompressed cache with the model's float32 keys and values
  (not rounded to bfloat16): its KL to the baseline is what rounding alone moves the model, so
  rows near it are not told apart by this protocol;
* bytes are everything a cache holds (``nbytes`` of every array, buffers at their grown
  capacity, measured before each step and averaged over the steps), reported over the
  uncompressed bfloat16 K/V and over mlx-lm's ``QuantizedKVCache(bits=4, group_size=64)``'s
  in the same run. Calibrated candidates (``+cal``, with ``--calibration``) hold their
  per-model constants apart, like the weights.
* ``--sensitivity`` (a profile written by ``benchmarks/palu/sensitivity.py``, from palu's
  calibration text) adds every ``+sens`` tier, the registry's and the studies' (``+sens``): bits per
  layer, keys against values, spread by the model's measured sensitivity; their rows record the
  profile's sha256.

Tier names are looked up in the registry and then the study configurations
(``benchmarks/studies/palu_tiers.py``), so every row's name keeps the configuration it recorded.

Results are written after every candidate; a rerun skips candidates already in the file with
the same settings (``--only`` runs one), so a long run can be cut into short ones. Each
candidate's per-position KL and negative log-likelihood are kept beside the baseline's
log-probabilities (in the temporary directory, outside the repository), so that every row gets
kvbench's paired 95% bootstrap intervals over the scored positions: its perplexity minus the
baseline's (``ppl_delta_ci95``) and, beside mlx-lm's 4-bit cache, its KL and perplexity minus
q4's (``vs_q4``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from kvbench.models import default_text_path
from kvbench.protocol import BOOTSTRAP_RESAMPLES, Settings, ppl_delta_interval, text_windows
from kvbench.results import environment_stamp, results_path, write_json
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from palu_mlx import KVCacheBuilder, KVCacheConfig
from palu_mlx.builder import model_kv_dims
from palu_mlx.compare import load_model, noise_floor_candidate
from palu_mlx.peers import PEERS as PALU_PEERS
from palu_mlx.tiers import TIERS as REGISTRY

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from studies.palu_tiers import ALL_TIERS, tier_config  # noqa: E402  (registry and study tiers)

OUT = results_path("palu_real_model.json")
#: palu tiers run by default (study configurations), and those also run calibrated with --calibration
TIERS = ("palu-3bit-scaled", "palu-2.5bit-scaled", "palu-2bit-scaled", "palu-3bit", "palu-1.5bit")
CALIBRATED = ("palu-3bit-scaled", "palu-2.5bit-scaled", "palu-2bit-scaled")
#: the fixed 3-bit coder with the real-K/V options added one at a time (the -scaled tier has all)
ABLATION = {
    "palu-3bit+sinks": dict(palu_sink_tokens=4),
    "palu-3bit+sinks+scale": dict(palu_sink_tokens=4, palu_token_scale=True),
}
#: the scaled tiers with keys and values weighed by relative error at the prefill (no file)
RELATIVE = (
    "palu-3.25bit-scaled+rel",
    "palu-3bit-scaled+rel",
    "palu-2.5bit-scaled+rel",
    "palu-2.25bit-scaled+rel",
    "palu-2bit-scaled+rel",
)
#: budgets between or beyond the named ones, built from a named tier with another palu_bits
#: (name -> (tier, bits)): the frontier on either side of q4's bytes and of half of them
OTHER_BITS = {
    "palu-3.5bit-scaled+sens": ("palu-3bit-scaled+sens", 3.5),
    "palu-1.5bit-scaled+sens": ("palu-2bit-scaled+sens", 1.5),
    "palu-1.5bit-scaled+rel": ("palu-2bit-scaled+rel", 1.5),
    "palu-1.25bit-scaled+sens": ("palu-2bit-scaled+sens", 1.25),
    "palu-1.7bit-compact+sens": ("palu-1.75bit-compact+sens", 1.7),
}
#: the compact side information one part at a time, and budgets around half of q4's bytes with all
#: of it (name -> (tier, fields replaced)); the registry's ``-compact`` tiers have all three parts
COMPACT_PARTS = {
    "palu-1.75bit-scaled-basis8+sens": ("palu-1.75bit-scaled+sens", dict(palu_basis_bits=8)),
    "palu-1.75bit-scaled-scale8+sens": ("palu-1.75bit-scaled+sens", dict(palu_scale_bits=8)),
    "palu-1.75bit-scaled-recent8+sens": ("palu-1.75bit-scaled+sens", dict(palu_recent_bits=8)),
    "palu-1.75bit-compact-recent16+sens": ("palu-1.75bit-compact+sens", dict(palu_recent_tokens=16)),
    # the padding bits of each row of codes spent on its channels: the same bytes (the study tier
    # palu-1.7bit-compact-fill+sens does this at 1.7 bits)
    "palu-1.75bit-compact-fill+sens": ("palu-1.75bit-compact+sens", dict(palu_fill_rows=True)),
}
PEERS = {"mlx-lm-q8": 8, "mlx-lm-q4": 4}
#: per-channel KIVI written in plain MLX (``palu_mlx.peers.kivi``): keys quantized per channel,
#: values per token, groups of 32, a 16-bit window of the newest tokens; it holds its codes
KIVI = ("kivi-k4v4", "kivi-k2v2")
#: the registry's rotation-code tiers (nothing fitted but each head's mean)
ROTATION = tuple(name for name, entry in REGISTRY.items() if entry.config.method == "rotation")
#: the rotation tier with its newest tokens exact in 16 bits instead of int8 (name -> (tier, fields))
ROTATION_ABLATION = {"rotation-4bit-recent16": ("rotation-4bit", dict(palu_recent_bits=16))}
#: the noise floor: the uncompressed cache holding the model's float32 keys and values, which every
#: other candidate gets rounded to bfloat16 (KL this small or smaller is rounding, not the cache)
FLOOR = "float32-kv"


def candidates(
    model: Any, calibration: str | None, sensitivity: str | None = None
) -> dict[str, tuple[Callable[[], list[Any]], dict]]:
    """name -> (cache factory, description of its configuration)."""
    head_dim, _ = model_kv_dims(model)
    out: dict[str, tuple[Callable[[], list[Any]], dict]] = {
        "baseline": (lambda: [KVCache() for _ in model.layers], {"class": "mlx_lm KVCache"}),
        FLOOR: (
            lambda: [KVCache() for _ in model.layers],
            {"class": "mlx_lm KVCache", "keys_and_values": "float32, not rounded"},
        ),
    }
    for name, bits in PEERS.items():
        out[name] = (
            lambda bits=bits: [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers],
            {"class": "mlx_lm QuantizedKVCache", "bits": bits, "group_size": 64},
        )
    for name in KIVI:
        out[name] = (
            lambda name=name: PALU_PEERS[name].factory(model),
            {"peer": name, **PALU_PEERS[name].record},
        )
    for tier in (*TIERS, *ROTATION):
        config = tier_config(tier, head_dim)
        out[tier] = (
            lambda config=config: KVCacheBuilder.for_model(model, config),
            config.keywords(),
        )
        if calibration is not None and tier in CALIBRATED:
            cal = config.replace(palu_calibration=calibration)
            out[f"{tier}+cal"] = (
                lambda cal=cal: KVCacheBuilder.for_model(model, cal),
                cal.keywords(),
            )

    def entry(config: KVCacheConfig) -> tuple[Callable[[], list[Any]], dict]:
        row = config.keywords()
        if config.palu_sensitivity is not None:
            layers = [c.config for c in KVCacheBuilder.for_model(model, config)]
            row.update(
                profile_sha256=hashlib.sha256(Path(config.palu_sensitivity).read_bytes()).hexdigest(),
                layer_bits=[c.palu_bits for c in layers],
                layer_key_weights=[c.palu_key_weight for c in layers],
                layer_value_weights=[c.palu_value_weight for c in layers],
            )
        return (lambda: KVCacheBuilder.for_model(model, config)), row

    configs: dict[str, KVCacheConfig] = {}
    if sensitivity is not None:
        profiled = [name for name, entry in ALL_TIERS.items() if entry.calibration == "sensitivity"]
        configs.update({name: tier_config(name, head_dim, sensitivity) for name in profiled})
    configs.update({name: tier_config(name, head_dim) for name in RELATIVE})
    for name, (source, bits) in OTHER_BITS.items():
        if source in configs:
            configs[name] = configs[source].replace(palu_bits=bits)
    for name, (source, fields) in COMPACT_PARTS.items():
        if source in configs:
            configs[name] = configs[source].replace(**fields)
    out.update({name: entry(config) for name, config in configs.items()})
    for name, (source, fields) in ROTATION_ABLATION.items():
        out[name] = entry(tier_config(source, head_dim).replace(**fields))
    base = tier_config("palu-3bit", head_dim)
    for name, fields in ABLATION.items():
        config = base.replace(**fields)
        out[name] = (
            lambda config=config: KVCacheBuilder.for_model(model, config),
            config.keywords(),
        )
    return out


def run_window(model: Any, make: Callable[[], list[Any]], window: list[int], context: int, step: int):
    """Log-probabilities ``[scored, V]`` (float64) and the bytes held before each step."""
    caches = make()
    logits = [model(mx.array(window[:context])[None], cache=caches)[0, -1:]]
    held = []
    for start in range(context, len(window) - 1, step):
        held.append(sum(int(c.nbytes) for c in caches))
        chunk = window[start : min(start + step, len(window) - 1)]
        logits.append(model(mx.array(chunk)[None], cache=caches)[0])
    z = mx.concatenate(logits, axis=0).astype(mx.float32)
    logp = np.array(z - mx.logsumexp(z, axis=-1, keepdims=True), dtype=np.float64)
    raw = (
        2
        * sum(  # bfloat16 K/V of the tokens held before each step
            2 * len(model.layers) * model_kv_dims(model)[1] * model_kv_dims(model)[0] * n
            for n in range(context, len(window) - 1, step)
        )
        // max(1, len(held))
    )
    return logp, float(np.mean(held)), raw


def mean_interval(diff: np.ndarray, seed: int = 0) -> list[float]:
    """``[low, high]``: the 2.5% and 97.5% quantiles of the mean of ``diff`` (paired per-position
    differences) over kvbench's bootstrap resamples of the positions."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(diff), (BOOTSTRAP_RESAMPLES, len(diff)))
    means = diff[idx].mean(axis=1)
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def add_intervals(rows: dict[str, dict], positions: dict[str, dict[str, np.ndarray]]) -> None:
    """Put each measured row's paired intervals in it: perplexity against the baseline's and,
    where q4 was measured, KL and perplexity against q4's (``positions``: name -> ``{"kl",
    "nll"}`` per scored position; rows without them are left as they are)."""
    base, q4 = positions.get("baseline"), positions.get("mlx-lm-q4")
    for name, row in rows.items():
        mine = positions.get(name)
        if name == "baseline" or mine is None or base is None:
            continue
        row["ppl_delta_ci95"] = ppl_delta_interval(base["nll"], mine["nll"])
        if q4 is not None and name != "mlx-lm-q4":
            row["vs_q4"] = {
                "kl_delta": float((mine["kl"] - q4["kl"]).mean()),
                "kl_delta_ci95": mean_interval(mine["kl"] - q4["kl"]),
                "ppl_delta": float(np.exp(mine["nll"].mean()) - np.exp(q4["nll"].mean())),
                "ppl_delta_ci95": ppl_delta_interval(q4["nll"], mine["nll"]),
            }


def add_protocol_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of this protocol (model, window, step, the files the calibrated candidates read),
    shared with the scripts that follow it (``benchmarks/studies/palu_byte_breakdown.py``)."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--scored", type=int, default=256)
    parser.add_argument("--step", type=int, default=32, help="scored tokens read per call")
    parser.add_argument("--calibration", default=None, help="a palu-mlx calibrate file: adds +cal rows")
    parser.add_argument(
        "--sensitivity", default=None, help="a sensitivity profile of the model: adds +sens rows"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_protocol_arguments(parser)
    parser.add_argument("--windows", type=int, default=1)
    parser.add_argument("--only", default=None, help="comma-separated candidates to run (default: all)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    model, tokenizer, info = load_model(args.model, "bfloat16", "float32")
    text = default_text_path().read_text(encoding="utf-8")
    tokens = tokenizer.encode(text, add_special_tokens=False)
    settings = Settings(
        windows=args.windows, context_tokens=args.context, scored_tokens=args.scored, prompt_count=1
    )
    windows = text_windows(tokens, settings)
    setup = {
        "model": info,
        "text": str(default_text_path().name),
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "windows": args.windows,
        "context_tokens": args.context,
        "scored_tokens": args.scored,
        "step_tokens": args.step,
        "calibration": None if args.calibration is None else Path(args.calibration).name,
        "calibration_sha256": None
        if args.calibration is None
        else hashlib.sha256(Path(args.calibration).read_bytes()).hexdigest(),
    }
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    if result.get("setup") != setup:
        result = {"setup": setup, "rows": {}}
    cands = candidates(model, args.calibration, args.sensitivity)
    floor = noise_floor_candidate(model)
    wanted = list(cands) if args.only is None else ["baseline", *args.only.split(",")]
    unknown = [n for n in wanted if n not in cands]
    if unknown:
        parser.error(f"--only: unknown candidates {unknown}; known: {', '.join(cands)}")

    # the uncompressed run's log-probabilities, kept between runs (large: outside the repository)
    key = hashlib.sha256(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:16]
    base_file = Path(tempfile.gettempdir()) / f"palu_real_model.{key}.baseline.npy"
    base = None
    if base_file.exists() and "baseline" in result["rows"]:
        base = np.load(base_file)
    targets = np.concatenate([np.array(w[args.context :]) for w in windows])

    def position_file(name: str) -> Path:
        return base_file.with_name(f"palu_real_model.{key}.{name}.npz")

    positions = {}
    if base is not None:
        positions["baseline"] = {"nll": -base[np.arange(len(targets)), targets]}
    for name in result["rows"]:
        if name != "baseline" and position_file(name).exists():
            with np.load(position_file(name)) as saved:
                positions[name] = {"kl": saved["kl"], "nll": saved["nll"]}
    for name in dict.fromkeys(wanted):
        make, config = cands[name]
        done = result["rows"].get(name)
        # a row made with another configuration under the same name is run again
        if (
            done
            and json.loads(json.dumps(config)) == done["config"]
            and not (name == "baseline" and base is None)
        ):
            continue
        started = time.perf_counter()
        # the floor runs with the K/V rounding off (palu-mlx compare's noise floor does the same)
        with floor.context() if name == FLOOR else nullcontext():
            runs = [run_window(model, make, w, args.context, args.step) for w in windows]
        logp = np.concatenate([r[0] for r in runs])
        held = float(np.mean([r[1] for r in runs]))
        raw = float(np.mean([r[2] for r in runs]))
        nll = -logp[np.arange(len(targets)), targets]
        row = {"config": config, "held_bytes": held, "raw_bytes": raw, "ppl": float(np.exp(nll.mean()))}
        if name == "baseline":
            base = logp
            np.save(base_file, logp)
            positions[name] = {"nll": nll}
        else:
            kl = np.maximum((np.exp(base) * (base - logp)).sum(axis=-1), 0.0)
            row.update(kl=float(kl.mean()), top1=float((base.argmax(-1) == logp.argmax(-1)).mean()))
            np.savez(position_file(name), kl=kl, nll=nll)
            positions[name] = {"kl": kl, "nll": nll}
        row["seconds"] = round(time.perf_counter() - started, 1)
        result["rows"][name] = row
        add_intervals(result["rows"], positions)
        q4 = result["rows"].get("mlx-lm-q4")
        for r in result["rows"].values():
            r["bytes_x_raw"] = r["held_bytes"] / r["raw_bytes"]
            r["bytes_x_q4"] = None if q4 is None else r["held_bytes"] / q4["held_bytes"]
        result.update(environment_stamp(["palu-mlx", "kvbench", "mlx", "mlx-lm"]))
        result["command"] = " ".join(["python benchmarks/palu/real_model.py", *(argv or sys.argv[1:])])
        write_json(args.out, result)  # written whole or not at all
        print(
            json.dumps(
                {"name": name, **{k: row.get(k) for k in ("kl", "top1", "ppl", "bytes_x_raw", "seconds")}}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
