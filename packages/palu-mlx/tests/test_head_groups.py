"""The default head grouping fits every KV head count: tiny random llama models with 1, 2, 3 and 8
KV heads (no download), built, generated with, installed and saved at ``KVCacheConfig``'s defaults."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvspec import KVConfigError
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from palu_mlx import KVCacheBuilder, KVCacheConfig, PaluKVCache, load_prompt_cache, save_prompt_cache

HEAD_DIM = 16


def tiny_llama(n_kv_heads: int) -> llama.Model:
    """A seeded random llama with ``n_kv_heads`` KV heads (query heads a multiple of them)."""
    mx.random.seed(n_kv_heads)
    n_heads = 3 * n_kv_heads if n_kv_heads == 3 else max(8, n_kv_heads)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=n_heads * HEAD_DIM,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        vocab_size=64,
        rope_theta=10000.0,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def greedy(model, prompt: list[int], steps: int, caches) -> list[int]:
    gen = generate_step(mx.array(prompt), model, max_tokens=steps, prompt_cache=caches)
    return [int(tok) for tok, _ in gen]


@pytest.mark.parametrize("n_kv_heads", [1, 2, 3, 8], ids=lambda h: f"{h}-kv-heads")
def test_default_config_serves_any_kv_head_count(n_kv_heads, tmp_path):
    model = tiny_llama(n_kv_heads)
    config = KVCacheConfig(method="palu", head_dim=HEAD_DIM)
    caches = KVCacheBuilder.for_model(model, config)
    prompt = [int(t) for t in mx.random.randint(0, 64, (40,), key=mx.random.key(1)).tolist()]
    tokens = greedy(model, prompt, 6, caches)
    assert len(tokens) == 6
    layer = caches[0]
    assert isinstance(layer, PaluKVCache) and layer.fitted and layer.rotary is not None
    # one projection per KV head
    assert layer._key_proj.n_groups == n_kv_heads and layer._value_proj.n_groups == n_kv_heads
    save_prompt_cache(str(tmp_path / "p.safetensors"), caches)
    restored = load_prompt_cache(str(tmp_path / "p.safetensors"))
    assert restored[0].offset == layer.offset and restored[0]._key_proj.n_groups == n_kv_heads
    KVCacheBuilder.install(model, config)
    try:
        assert all(isinstance(c, PaluKVCache) for c in model.make_cache())
    finally:
        KVCacheBuilder.uninstall(model)


def test_explicit_group_count_is_still_checked_against_the_model():
    model = tiny_llama(3)
    with pytest.raises(KVConfigError, match="palu_n_head_groups=2 must divide the model's 3"):
        KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=HEAD_DIM, palu_n_head_groups=2))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=HEAD_DIM, palu_n_head_groups=1))
    assert len(caches) == 2


def test_group_count_none_resolves_per_layer_heads():
    config = KVCacheConfig()
    assert config.palu_n_head_groups is None and config.head_groups(3) == 3
    assert KVCacheConfig(palu_n_head_groups=1).head_groups(3) == 1
    with pytest.raises(KVConfigError, match="palu_n_head_groups=0"):
        KVCacheConfig(palu_n_head_groups=0)
