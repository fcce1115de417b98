"""Greedy tokens with palu caches, in one process or on each rank of ``mlx.launch`` (tensor parallel).

    python tp_worker.py MODEL TIER OUT.json                      # one process
    mlx.launch --backend ring -n 2 tp_worker.py MODEL TIER OUT.json

Rank 0 writes ``{"tokens": [...], "kv_heads": n, "world": size}``: the greedy tokens and the KV
heads of this rank's caches (test_tensor_parallel.py compares the two runs).
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load, sharded_load
from palu_mlx import KVCacheBuilder, model_kv_dims
from palu_mlx.serving import palu_config

PROMPT = (
    "The json module encodes Python objects as JSON text and decodes JSON text back into Python "
    "objects. Its dump and dumps functions take an object and return text; load and loads do the "
    "reverse. Keys of a dictionary must be strings, and a float that is not finite is written as"
)


def main() -> int:
    model_path, tier_name, out = sys.argv[1:4]
    group = mx.distributed.init()
    if group.size() > 1:
        model, tokenizer = sharded_load(model_path, tensor_group=group)
    else:
        model, tokenizer = load(model_path)
    if tier_name != "none":  # "none": mlx-lm's own cache, for the reference
        args = type("Args", (), {"palu_tier": tier_name, "palu_bits": None, "calibration": None})
        KVCacheBuilder.install(model, palu_config(model, args))
    cache = make_prompt_cache(model)
    prompt = mx.array(tokenizer.encode(PROMPT))
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=24, prompt_cache=cache)]
    if group.rank() == 0:
        heads = {c._shape[1] for c in cache if getattr(c, "_shape", None)}
        record = {
            "tokens": tokens,
            "kv_heads": sorted(heads),
            "dims": list(model_kv_dims(model)),
            "world": group.size(),
        }
        with open(out, "w") as f:
            json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
