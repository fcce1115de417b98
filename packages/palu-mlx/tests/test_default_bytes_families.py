"""The zero-argument default's bytes on tiny random-weight models of mlx-lm's families.

``KVCacheBuilder.for_model(model, KVCacheConfig())`` after a 400-token prompt and 16 greedy tokens,
bfloat16 (the MoE families in float32: MLX's CPU gather matmul has no bfloat16), 6 layers, hidden
256, 2 KV heads of 64: every array reachable from the caches (once) over the same count for mlx-lm's
own caches on the same run. The default is the rotation code (:mod:`palu_mlx.rotation_code`) on
every layer; sliding layers (gemma3_text's, a window of 128) are counted with the rest: mlx-lm's
RotatingKVCache against palu's rotating cache.
"""

from __future__ import annotations

import json
import os
import warnings

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from palu_helpers import reachable_nbytes
from palu_mlx import KVCacheBuilder, KVCacheConfig, PreRopeFallbackWarning
from test_pre_rope_families import COMMON, FAMILIES, FLOAT32_ONLY, build_family

#: a file to append each family's measurement to (benchmarks/tools/families.py sets it)
RECORD = os.environ.get("PALU_FAMILIES_RECORD")
PROMPT, NEW = 400, 16
#: the most the default may hold, as a fraction of mlx-lm's caches' bytes
TARGET = 0.40
SIZES = dict(
    hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, vocab_size=512
)


def sized(extra: dict) -> dict:
    """A family's extra arguments at the sizes above (heads of 64, windows of 128)."""
    out = dict(extra)
    for key in ("head_dim", "query_pre_attn_scalar"):
        if key in out:
            out[key] = 64
    if "sliding_window" in out:
        out["sliding_window"] = 128
    if "num_layers" in out:
        out["num_layers"] = SIZES["num_hidden_layers"]
    return out


def ratio(family: str) -> float:
    model = build_family(family, {**COMMON, **SIZES}, sized(FAMILIES[family][0]))
    if family not in FLOAT32_ONLY:
        model.set_dtype(mx.bfloat16)
    prompt = mx.random.randint(3, SIZES["vocab_size"] - 1, (PROMPT,), key=mx.random.key(0))

    def held(caches) -> int:
        for _ in generate_step(prompt, model, max_tokens=NEW, prompt_cache=caches):
            pass
        return reachable_nbytes(caches)

    with warnings.catch_warnings():
        warnings.simplefilter("error", PreRopeFallbackWarning)
        palu = KVCacheBuilder.for_model(model, KVCacheConfig())
    got = held(palu) / held(make_prompt_cache(model))
    if RECORD:
        codes = sorted({_code(c) for c in palu})
        row = dict(family=family, ratio=got, target=TARGET, meets_target=got <= TARGET, codes=codes,
                   dtype="float32" if family in FLOAT32_ONLY else "bfloat16")  # fmt: skip
        with open(RECORD, "a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")
    return got


#: how each palu cache class holds a layer, in the words of the families table
_KINDS = {"PaluKVCache": "fitted projection", "RotationKVCache": "rotation code"}


def _code(cache) -> str:
    """How a layer is held: the rotation code or a fitted projection, in a window of some size for
    sliding layers."""
    inner = getattr(cache, "cache", None)
    if inner is None:
        return _KINDS.get(type(cache).__name__, type(cache).__name__)
    return f"{_KINDS.get(type(inner).__name__, type(inner).__name__)}, window {cache.max_size}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_default_holds_at_most_the_target_of_mlx_lm_caches(family):
    got = ratio(family)
    assert got <= TARGET, f"{family}: {got:.3f}x mlx-lm's caches"
