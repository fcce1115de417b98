"""The zero-argument default on tiny random-weight models of many transformers families.

``apply_flash_codec(model)`` with nothing else must compress whatever its framework loads: after a
400-token prompt and 16 greedy tokens in bfloat16, every tensor reachable from the returned cache
(counted once per storage) is compared with transformers' ``DynamicCache`` on the same run, and
the tokens with the materialized path of the same codec (attention on the codes changes where
attention is computed, not what it computes).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from flashcodec.hf import (  # noqa: E402
    FlashCodecCache,
    apply_flash_codec,
    config_layer_types,
    remove_flash_codec,
    resident_bytes,
)
from flashcodec.tiers import default_codec  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

PROMPT, NEW = 400, 16
#: a file to append each family's measurement to (benchmarks/tools/families.py sets it)
RECORD = os.environ.get("FLASHCODEC_FAMILIES_RECORD")
#: the most the default may hold, as a fraction of DynamicCache's bytes
TARGET = 0.40

#: families whose every attention layer is full attention (no sliding window given here), and
#: families with sliding-window layers (a window of 128) beside full ones
COVERED = ["llama", "qwen2", "qwen3", "qwen3_moe", "olmo2", "granite", "gpt_neox", "phi3", "smollm3"] + [
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "cohere2",
    "gpt_oss",
    "qwen3-sliding",
]
#: families whose every layer slides (a window of 128)
ALL_SLIDING = ["mistral", "starcoder2", "cohere"]
SLIDING = ["gemma2", "gemma3_text", "cohere2", "gpt_oss", "qwen3-sliding", *ALL_SLIDING]


def options(name: str) -> dict:
    """The config of family ``name``'s tiny model (``<family>-sliding``: qwen's sliding lower layers)."""
    kind, _, variant = name.partition("-")
    config = dict(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=512, vocab_size=512, max_position_embeddings=1024, pad_token_id=0,
    )  # fmt: skip
    if name in SLIDING:
        config["sliding_window"] = 128
    if variant == "sliding":
        config.update(use_sliding_window=True, max_window_layers=3)
    if kind == "qwen3_moe":
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    if kind in ("mixtral", "gpt_oss"):
        config.update(num_local_experts=4, num_experts_per_tok=2)
    return config


def tiny_family(name: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A seeded 6-layer model of family ``name`` (hidden 256, 2 KV heads of 64), eval mode."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(name.partition("-")[0], **options(name))
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def run(model, cache=None):
    ids = torch.randint(3, 500, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    greedy = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(ids, **greedy) if cache is None else model.generate(ids, cache=cache, **greedy)
    return out.sequences, out.cache


def default_run(model) -> tuple[torch.Tensor, FlashCodecCache]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback or "nothing compressed" warning
        apply_flash_codec(model)
        try:
            tokens, cache = run(model)
        finally:
            remove_flash_codec(model)
    assert isinstance(cache, FlashCodecCache) and cache.codec_layer_indices
    return tokens, cache


def check_family(name: str) -> float:
    """The default's bytes over DynamicCache's in bfloat16; its tokens checked in float32 (where
    the two paths' rounding cannot flip a near-tie of a random model) against the materialized path."""
    model = tiny_family(name)
    native = DynamicCache(config=model.config)
    run(model, native)
    _, cache = default_run(model)
    ratio = resident_bytes(cache) / resident_bytes(native)
    model = tiny_family(name, torch.float32)
    materialized, _ = run(model, FlashCodecCache.from_config(model.config, codec=default_codec()))
    tokens, _ = default_run(model)
    same = torch.equal(tokens, materialized)
    if RECORD:
        types = sorted(set(config_layer_types(model.config)[0]))
        row = dict(
            family=name, ratio=ratio, target=TARGET, meets_target=ratio <= TARGET, same_tokens=same,
            layer_types=types, window=options(name).get("sliding_window"),
        )  # fmt: skip
        with open(RECORD, "a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")
    assert same
    return ratio


@pytest.mark.parametrize("name", COVERED + ALL_SLIDING)
def test_the_default_holds_at_most_the_target_of_dynamic_cache(name):
    ratio = check_family(name)
    assert ratio <= TARGET, f"{name}: {ratio:.3f}x DynamicCache"
