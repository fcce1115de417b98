"""The zero-argument default on tiny random-weight models of many transformers families.

``apply_flash_codec(model)`` with nothing else must compress whatever its framework loads: after a
400-token prompt and 16 greedy tokens in bfloat16, every tensor reachable from the returned cache
(counted once per storage) is compared with transformers' ``DynamicCache`` on the same run, and
the tokens with the materialized path of the same codec (attention on the codes changes where
attention is computed, not what it computes).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from flashcodec.hf import FlashCodecCache, apply_flash_codec, remove_flash_codec  # noqa: E402
from flashcodec.tiers import default_codec  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

PROMPT, NEW = 400, 16
#: the most the default may hold, as a fraction of DynamicCache's bytes
TARGET = 0.40

#: families whose every attention layer is full attention (or given no sliding window here)
FULL = ["llama", "qwen2", "qwen3", "qwen3_moe", "olmo2", "granite", "gpt_neox", "phi3", "smollm3"]
#: families with sliding-window layers: those layers keep transformers' native bounded cache
SLIDING = ["mistral", "gemma2", "gemma3_text", "starcoder2", "cohere", "qwen3-sliding"]


def tiny_family(name: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A seeded 6-layer model of family ``name`` (hidden 256, 2 KV heads of 64), eval mode."""
    kind, _, variant = name.partition("-")
    options = dict(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=512, vocab_size=512, max_position_embeddings=1024, pad_token_id=0,
    )  # fmt: skip
    if name in SLIDING:
        options["sliding_window"] = 128
    if variant == "sliding":  # qwen's sliding lower layers
        options.update(use_sliding_window=True, max_window_layers=3)
    if kind == "qwen3_moe":
        options.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, **options)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def reachable_bytes(root: object) -> int:
    """Bytes of every tensor storage reachable from ``root`` through attributes and containers, once."""
    seen_objects: set[int] = set()
    seen_storages: set[tuple[int, int]] = set()
    total, stack = 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
            stack.extend(vars(obj).values())
    return total


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
    ratio = reachable_bytes(cache) / reachable_bytes(native)
    model = tiny_family(name, torch.float32)
    materialized, _ = run(model, FlashCodecCache.from_config(model.config, codec=default_codec()))
    tokens, _ = default_run(model)
    assert torch.equal(tokens, materialized)
    return ratio


@pytest.mark.parametrize("name", FULL)
def test_the_default_holds_at_most_the_target_of_dynamic_cache(name):
    ratio = check_family(name)
    assert ratio <= TARGET, f"{name}: {ratio:.3f}x DynamicCache"


@pytest.mark.xfail(
    strict=True, reason="sliding-window layers keep transformers' 16-bit cache (not coded yet)"
)
@pytest.mark.parametrize("name", SLIDING)
def test_sliding_window_families_reach_the_target_too(name):
    ratio = check_family(name)
    assert ratio <= TARGET, f"{name}: {ratio:.3f}x DynamicCache"
