"""A tiny random-weight *hybrid* model for tests of hybrid handling, built in memory.

Hybrid models (Qwen3.5, Qwen3-Next) interleave ``linear_attention`` layers (gated delta-net: a
fixed-size recurrent state, no growing K/V) with ``full_attention`` layers (an ordinary K/V
cache). A KV-cache codec must compress only the latter and leave the former alone, so tests need a
model with both. Nothing is downloaded: the weights are random, seeded.

Depends on torch and transformers only. pytest puts this tests folder on ``sys.path``, so a test
imports it by name::

    from hybrid_fixture import make_tiny_hybrid_model
    model = make_tiny_hybrid_model()          # transformers Qwen3_5ForCausalLM, eval mode, float32
"""

from __future__ import annotations

__all__ = ["HYBRID_LAYER_TYPES", "make_tiny_hybrid_config", "make_tiny_hybrid_model", "seeded_model"]

#: layer pattern of the fixture: linear layers around full-attention ones, like Qwen3.5's 3:1 mix
HYBRID_LAYER_TYPES: tuple[str, ...] = (
    "linear_attention",
    "full_attention",
    "linear_attention",
    "full_attention",
)


def make_tiny_hybrid_config(layer_types: tuple[str, ...] = HYBRID_LAYER_TYPES, vocab_size: int = 256):
    """A ``transformers.Qwen3_5TextConfig`` (model_type ``qwen3_5_text``) small enough for CPU tests.

    Full-attention layers: 4 query heads, 2 key/value heads, head_dim 32 (K/V ``[B, 2, S, 32]``).
    Linear-attention layers: 2 key heads and 2 value heads of dim 16, conv kernel 4.
    """
    from transformers import Qwen3_5TextConfig

    if not layer_types or not {"linear_attention", "full_attention"} <= set(layer_types):
        raise ValueError(
            f"layer_types must mix 'linear_attention' and 'full_attention'; got {list(layer_types)}"
        )
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def make_tiny_hybrid_model(seed: int = 0, layer_types: tuple[str, ...] = HYBRID_LAYER_TYPES):
    """A random-weight ``transformers.Qwen3_5ForCausalLM`` in eval mode, float32, on CPU.

    Same ``seed`` gives the same weights. Input ``input_ids`` int64 ``[B, S]`` with ids below
    ``model.config.vocab_size`` (256); logits float32 ``[B, S, 256]``.
    """
    from transformers import Qwen3_5ForCausalLM

    return seeded_model(Qwen3_5ForCausalLM, make_tiny_hybrid_config(layer_types), seed)


def seeded_model(model_cls, config, seed: int = 0):
    """``model_cls(config)`` in eval mode, its random weights drawn from ``seed``: the same seed gives
    the same weights, and the caller's global RNG state is left as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.eval()
