"""Pre-RoPE keys decided by the mechanism: tiny random-weight models of mlx-lm's families, each layer
probed (``layer_rotary``), and attention modules that do not follow it falling back with a warning."""

from __future__ import annotations

import importlib
import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from palu_helpers import make_tiny_qwen3
from palu_mlx import (
    PRE_ROPE_ARCHITECTURES,
    KVCacheBuilder,
    KVCacheConfig,
    PaluKVCache,
    PreRopeFallbackWarning,
    model_rotaries,
)

COMMON = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=256,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    max_position_embeddings=4096,
)
HEAD_DIM = 32  # 128 / 4 where a family does not state it
#: family -> (its extra args, the channels its RoPE rotates per layer: None for a layer without RoPE)
FAMILIES = {
    "llama": ({}, [32, 32]),
    "qwen2": ({}, [32, 32]),
    "qwen2_moe": (
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        [32, 32],
    ),
    "qwen3": ({"head_dim": 32}, [32, 32]),
    "gemma2": ({"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 4096}, [32, 32]),
    "gemma3_text": (
        {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 4096, "sliding_window_pattern": 2},
        [32, 32],  # layer 0 slides: it keeps mlx-lm's rotating cache
    ),
    "phi3": ({}, [32, 32]),
    "olmo2": ({}, [32, 32]),
    "granite": (
        {
            "attention_bias": False,
            "mlp_bias": False,
            "logits_scaling": 1.0,
            "attention_multiplier": 0.1,
            "embedding_multiplier": 1.0,
            "residual_multiplier": 1.0,
        },
        [32, 32],
    ),
    "starcoder2": ({"norm_epsilon": 1e-5}, [32, 32]),
    "smollm3": ({"no_rope_layer_interval": 2}, [32, None]),  # layer 1 has no RoPE (NoPE)
    "cohere": ({"layer_norm_eps": 1e-5, "logit_scale": 1.0}, [32, 32]),  # adjacent-pair RoPE
    "gpt_neox": (
        {"layer_norm_eps": 1e-5, "rotary_emb_base": 10000, "rotary_pct": 0.25, "use_parallel_residual": True},
        [8, 8],  # partial rotary: a quarter of each head's channels
    ),
    # the attention that owns the RoPE sits one module deeper (layer.attn.attention)
    "exaone": (
        {"num_layers": 2, "layer_norm_epsilon": 1e-5, "attention_bias": False, "mlp_bias": False},
        [32, 32],
    ),
    "qwen3_moe": (
        {
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
        },
        [32, 32],
    ),
}
FLOAT32_ONLY = {"qwen2_moe", "qwen3_moe"}
FULL_RANK = dict(palu_rank=HEAD_DIM, palu_hi_bit=16, palu_lo_bit=16)


def build_family(family: str, common: dict, extra: dict):
    """A seeded random model of mlx-lm's ``family`` from ``common`` and ``extra`` arguments."""
    try:
        module = importlib.import_module(f"mlx_lm.models.{family}")
        mx.random.seed(0)
        model = module.Model(module.ModelArgs.from_dict({**common, "model_type": family, **extra}))
    except (ImportError, TypeError, ValueError) as exc:
        pytest.skip(f"this mlx-lm cannot build a tiny {family}: {exc}")
    mx.eval(model.parameters())
    return model


def _build(family: str):
    return build_family(family, COMMON, FAMILIES[family][0])


def _greedy(model, prompt, steps, caches) -> list[int]:
    gen = generate_step(mx.array(prompt), model, max_tokens=steps, prompt_cache=caches)
    return [int(token) for token, _ in gen]


def _quietly(model, config):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreRopeFallbackWarning)
        return KVCacheBuilder.for_model(model, config)


def test_the_exported_list_names_the_families_tested_here():
    assert set(FAMILIES) | {"mistral"} == PRE_ROPE_ARCHITECTURES  # mistral loads through llama


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_codes_keys_before_rope_and_keeps_the_full_rank_tokens(family):
    model = _build(family)
    _, rotated = FAMILIES[family]
    caches = _quietly(model, KVCacheConfig(**FULL_RANK))
    for cache, dims in zip(caches, rotated, strict=True):
        if type(cache) is PaluKVCache:
            assert (None if cache.rotary is None else cache.rotary.dims) == dims
    assert any(type(c) is PaluKVCache and c.rotary is not None for c in caches)
    # full rank, unquantized: un-rotating, coding and re-rotating must give mlx-lm's own tokens
    prompt = list(range(3, 3 + 2 * HEAD_DIM + 5))
    assert _greedy(model, prompt, 12, caches) == _greedy(model, prompt, 12, make_prompt_cache(model))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_default_config_takes_the_pre_rope_path_without_a_warning(family):
    model = _build(family)
    # bfloat16 as checkpoints ship: the probe must tell rounding from a misfit (MLX's CPU gather
    # matmul, the MoE experts, runs in float32 only)
    if family not in FLOAT32_ONLY:
        model.set_dtype(mx.bfloat16)
    caches = _quietly(model, KVCacheConfig())
    prompt = list(range(3, 3 + 2 * HEAD_DIM + 5))
    tokens = _greedy(model, prompt, 6, caches)
    assert len(tokens) == 6 and all(0 <= t < COMMON["vocab_size"] for t in tokens)
    assert all(c.fitted for c in caches if type(c) is PaluKVCache)


class _LouderRoPE(nn.Module):
    """A rotation that also scales magnitudes (as YaRN's does): not one palu can invert exactly."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base

    def __call__(self, x, offset: int = 0):
        return 1.25 * self.base(x, offset=offset)


class _ShiftedAttention(nn.Module):
    """An attention whose RoPE turns keys to positions ``2 * cache.offset + i``, not the cache's (a
    constant shift would be harmless: un-rotating and re-rotating at the cache's positions keeps it)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.inner = attn
        self.rope = attn.rope

    def __call__(self, x, mask=None, cache=None):
        outer = cache

        class Shifted:
            offset = 2 * outer.offset

            def update_and_fetch(self, keys, values):
                return outer.update_and_fetch(keys, values)

        return self.inner(x, mask=mask, cache=Shifted())


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (
            lambda attn: setattr(attn, "rope", _LouderRoPE(attn.rope)),
            r"_LouderRoPE\) is not a plain rotation",
        ),
        (_ShiftedAttention, r"not its RoPE's rotation at positions cache\.offset \+ i"),
    ],
    ids=["rope-scales-magnitudes", "rope-at-other-positions"],
)
def test_an_attention_off_the_mechanism_falls_back_naming_the_layer_and_why(change, why):
    model = make_tiny_qwen3(model_type="novelarch")
    layer = model.layers[1]
    changed = change(layer.self_attn)
    if changed is not None:
        layer.self_attn = changed
    with pytest.warns(PreRopeFallbackWarning, match=rf"'novelarch'.*layer 1: .*{why}"):
        caches = KVCacheBuilder.for_model(model, KVCacheConfig())
    assert all(c.rotary is None for c in caches)
    with pytest.warns(PreRopeFallbackWarning):
        assert model_rotaries(model) is None


def test_a_layer_without_an_attention_module_falls_back():
    model = make_tiny_qwen3()
    del model.layers[0]["self_attn"]  # the probe has nothing to run
    with pytest.warns(PreRopeFallbackWarning, match="layer 0: it has no attention module"):
        assert model_rotaries(model) is None


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_keys_rounded_to_16_bits_before_rope_still_take_the_pre_rope_path(family):
    # palu-mlx compare --compute-dtype float32 (and the demo) run a float32 model whose K/V
    # projections round to bfloat16: the probe must read that rounding as rounding
    from palu_mlx.compare import round_kv_outputs

    model = _build(family)
    round_kv_outputs(model, mx.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreRopeFallbackWarning)
        rotaries = model_rotaries(model)
    assert rotaries is not None and all(r is not None for r in rotaries)
