"""Greedy tokens with palu caches, in one process or on each rank of ``mlx.launch`` (tensor parallel).

    python tp_worker.py MODEL TIERS OUT.json [CALIBRATION ...]                      # one process
    mlx.launch --backend ring -n 2 tp_worker.py MODEL TIERS OUT.json [CALIBRATION ...]

``TIERS`` is a comma-separated list of palu tier names ("none": mlx-lm's own cache); ``<tier>+cal<i>``
runs the tier with the ``i``-th CALIBRATION file (a whole-model file). The model is loaded once;
each tier gets fresh caches. Rank 0 writes ``{"world": size, "tiers": {name: record}}``, a record
holding the greedy tokens, the KV heads of this rank's caches, every rank's held KV bytes
(``kv_bytes``, one entry per rank) and, per palu layer, the key and value widths and quantizer
steps of every head (gathered from the ranks in head order), so test_tensor_parallel.py can
compare the codecs, not only the tokens; or ``{"error": message}`` when building the caches
raised a ``KVSpecError`` (a calibration of another model).
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
from kvspec import KVSpecError
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load, sharded_load
from palu_mlx import KVCacheBuilder, model_kv_dims
from palu_mlx.serving import palu_config

PROMPT = (
    "The json module encodes Python objects as JSON text and decodes JSON text back into Python "
    "objects. Its dump and dumps functions take an object and return text; load and loads do the "
    "reverse. Keys of a dictionary must be strings, and a float that is not finite is written as"
)


def _gathered(group, arr: np.ndarray) -> list:
    """Every rank's ``arr`` (same shape on each) stacked in rank order: heads in model order."""
    if group.size() == 1:
        return arr.tolist()
    # on the stream generate_step ran the model's all_sums on: collectives of two streams in
    # flight at once would pair up the ranks' messages wrongly
    with mx.stream(generation_stream):
        return np.array(mx.distributed.all_gather(mx.array(arr), group=group)).tolist()


def _codec(group, cache) -> list:
    out = []
    for c in cache:
        # a palu cache's coders (fitted at the prefill, or a calibration's)
        coders = {w: getattr(c, f"_{w}_coder", None) for w in ("key", "value")}
        if None in coders.values():
            continue
        layer = {}
        for which, coder in coders.items():
            widths = getattr(coder, "fixed_widths", None) or [
                [s.start, s.stop, s.bits] for s in coder.segments
            ]
            layer[f"{which}_widths"] = list(widths)
            steps = coder.constants().get("steps")
            if steps is not None:
                layer[f"{which}_steps"] = _gathered(group, np.array(steps, dtype=np.float32))
        out.append(layer)
    return out


def run(model, tokenizer, group, tier: str, calibration: str | None) -> dict:
    KVCacheBuilder.uninstall(model)
    if tier != "none":  # "none": mlx-lm's own cache, for the reference
        args = type("Args", (), {"palu_tier": tier, "palu_bits": None, "calibration": calibration})
        try:
            KVCacheBuilder.install(model, palu_config(model, args))
        except KVSpecError as exc:
            return {"error": str(exc)}
    cache = make_prompt_cache(model)
    prompt = mx.array(tokenizer.encode(PROMPT))
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=24, prompt_cache=cache)]
    held = sum(int(c.nbytes) for c in cache)
    return {
        "tokens": tokens,
        "kv_heads": sorted({c._shape[1] for c in cache if getattr(c, "_shape", None)}),
        "kv_bytes": [int(b) for b in _gathered(group, np.array([held], dtype=np.float32))],
        "codec": _codec(group, cache) if tier != "none" else [],
    }


def main() -> int:
    model_path, tiers, out = sys.argv[1:4]
    calibrations = sys.argv[4:]
    group = mx.distributed.init()
    if group.size() > 1:
        model, tokenizer = sharded_load(model_path, tensor_group=group)
    else:
        model, tokenizer = load(model_path)
    record: dict = {"world": group.size(), "dims": list(model_kv_dims(model)), "tiers": {}}
    for name in tiers.split(","):
        tier, _, cal = name.partition("+cal")
        record["tiers"][name] = run(model, tokenizer, group, tier, calibrations[int(cal)] if cal else None)
    if group.rank() == 0:
        with open(out, "w") as f:
            json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
