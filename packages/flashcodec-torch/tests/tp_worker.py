"""One rank of the tensor-parallel check (run by test_tensor_parallel.py, or by hand).

    torchrun --nproc_per_node 2 packages/flashcodec-torch/tests/tp_worker.py \
        --model benchmarks/model/tiny-qwen3 --tiers png-keep1,kivi64r-k4v4-w64i8-s8 --out /tmp/tp.json

``--world 1`` loads the model in one process (no ``tp_plan``): the reference. Otherwise the model
is loaded with ``tp_plan="auto"`` on the ranks torchrun started (gloo on CPU), so each rank holds
its share of the attention heads and caches only its own KV heads. For every tier the greedy
continuation of a fixed prompt is generated with a :class:`flashcodec.hf.FlashCodecCache` of that
tier's codec, once with each attention (the cases ``<tier>+materialized`` and ``<tier>+codes``); rank 0 writes a JSON object
``{"world": n, "tiers": {name: {"tokens": [...], "kv_heads": h, "held_bytes": n,
"coded_steps": n, "chunked_steps": n, "fallbacks": {...}}}}``, and every rank writes its own
``<out>.rank<r>`` with the same fields for the heads it caches.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
from flashcodec.tiers import ATTENTIONS

PROMPT = (
    "The loop should not be running.\n\nThis is idempotent and the cache keeps every block it has "
    "written, so a second call changes nothing that the first one did not already change."
)


def case_names(tiers: list[str]) -> list[str]:
    """Every tier with each attention: ``<tier>+materialized``, ``<tier>+codes``."""
    return [f"{name}+{attention}" for name in tiers for attention in ATTENTIONS]


def tier_tokens(model, ids, case: str, new_tokens: int) -> dict:
    """Greedy tokens and cache figures of one case: ``<tier>+<attention>``."""
    from flashcodec.hf import FlashCodecCache, attending_on
    from flashcodec.tiers import tier

    name, _, attention = case.partition("+")
    t = tier(name, attention)
    with attending_on(model, t.attention, backend="torch") as stats:
        cache = FlashCodecCache.from_config(model.config, codec=t.codec)
        out = model.generate(
            ids, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    first = cache.layers[cache.codec_layer_indices[0]].codec_cache
    return {
        "tokens": out[0].tolist(),
        "kv_heads": first.keys.heads,
        "held_bytes": cache.storage_bytes().held,
        "coded_steps": 0 if stats is None else stats.coded,
        "chunked_steps": 0 if stats is None else stats.chunked,
        "fallbacks": {} if stats is None else dict(stats.fallbacks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument(
        "--tiers",
        required=True,
        help="comma-separated tier names (flashcodec.tiers); each runs with each attention (+codes, +materialized)",
    )
    parser.add_argument("--new-tokens", type=int, default=80)
    parser.add_argument("--world", type=int, default=None, help="1: one process, no tensor parallel")
    parser.add_argument("--out", required=True, help="JSON written by rank 0")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    world = int(os.environ.get("WORLD_SIZE", "1")) if args.world is None else args.world
    kwargs = {"dtype": torch.float32}
    if world > 1:
        kwargs["tp_plan"] = "auto"
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs).eval()
    ids = AutoTokenizer.from_pretrained(args.model)(PROMPT, return_tensors="pt").input_ids
    rank = torch.distributed.get_rank() if world > 1 else 0
    result = {"world": world, "tiers": {}}
    with torch.no_grad():
        for case in case_names(args.tiers.split(",")):
            result["tiers"][case] = tier_tokens(model, ids, case, args.new_tokens)
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump(result, f)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
