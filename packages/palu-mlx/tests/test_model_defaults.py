"""``KVCacheConfig()`` with no argument: what it leaves unset is taken from the model it is built for."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from kvspec import KVConfigError
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache
from palu_helpers import make_tiny_qwen3
from palu_mlx import KVCacheBuilder, KVCacheConfig, PaluKVCache
from palu_mlx.rotation_code import RotationKVCache
from palu_mlx.tiers import tier

#: a SmolLM2-like llama: ``head_dim`` unset in its args (the model takes hidden / heads = 48)
SMOL_ARGS = dict(
    model_type="llama",
    hidden_size=144,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=3,
    num_key_value_heads=1,
    rms_norm_eps=1e-5,
    vocab_size=256,
    tie_word_embeddings=True,
)


def _smol(seed: int = 0) -> llama.Model:
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(SMOL_ARGS))
    mx.eval(model.parameters())
    return model


def _greedy(model, caches, prompt: mx.array, steps: int) -> list[int]:
    logits = model(prompt[None], cache=caches)
    out = []
    for _ in range(steps):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=caches)
    return out


def test_the_zero_argument_config_is_the_default_tier():
    assert KVCacheConfig() == tier("rotation-3.5bit").config
    assert KVCacheConfig(method="palu") == tier("palu-2.25bit-scaled+rel").config


@pytest.mark.parametrize(
    ("make", "head_dim", "n_kv"),
    [(make_tiny_qwen3, 32, 4), (_smol, 48, 1)],
    ids=["qwen3-head-dim-given", "llama-head-dim-none"],
)
def test_the_zero_argument_config_takes_the_model_s_dims(make, head_dim, n_kv):
    model = make()
    assert (model.args.head_dim is None) is (make is _smol)
    prompt = mx.array(list(range(3, 3 + 3 * head_dim)))  # more than head_dim tokens: fitted at the prefill
    for config, kind in ((KVCacheConfig(), RotationKVCache), (KVCacheConfig(method="palu"), PaluKVCache)):
        caches = KVCacheBuilder.for_model(model, config)
        assert all(type(c) is kind for c in caches)
        # the config each cache holds is the given one with the model's head dim, nothing else changed
        assert {c.config for c in caches} == {dataclasses.replace(config, head_dim=head_dim)}
        tokens = _greedy(model, caches, prompt, 4)
        assert len(tokens) == 4 and all(0 <= t < model.args.vocab_size for t in tokens)
        # one projection (rotation) per KV head, the model's count
        assert all(c._key_proj.mean.shape[0] == c._value_proj.mean.shape[0] == n_kv for c in caches)
        # the same through install (mlx-lm building its own caches)
        KVCacheBuilder.install(model, config)
        try:
            assert all(type(c) is kind and c.config.head_dim == head_dim for c in model.make_cache())
        finally:
            KVCacheBuilder.uninstall(model)


def test_the_readme_s_model_args_head_dim_works_when_the_args_leave_it_unset():
    model = _smol()
    config = KVCacheConfig(method="palu", head_dim=model.args.head_dim)
    assert config.head_dim is None
    assert all(c.config.head_dim == 48 for c in KVCacheBuilder.for_model(model, config))


@pytest.mark.parametrize("build", ["for_model", "install"])
def test_a_head_dim_given_that_differs_from_the_model_s_is_refused_leaving_it_unchanged(build):
    model = _smol()
    before_attention = type(model.layers[0].self_attn).__call__
    config = KVCacheConfig(head_dim=64, palu_n_head_groups=1)
    before = dataclasses.asdict(config)
    with pytest.raises(KVConfigError, match=r"head_dim=64 does not match the model's head_dim 48") as info:
        getattr(KVCacheBuilder, build)(model, config)
    assert isinstance(info.value, ValueError) and "allowed: 48" in str(info.value)
    assert dataclasses.asdict(config) == before
    assert "make_cache" not in vars(model) and type(model.layers[0].self_attn).__call__ is before_attention
    assert all(type(c) is KVCache for c in model.make_cache())


def test_a_rank_above_the_model_s_head_dim_is_refused_naming_both():
    with pytest.raises(KVConfigError, match=r"palu_rank=64 exceeds the model's head_dim 48.*\[1, 48\]"):
        KVCacheBuilder.for_model(_smol(), KVCacheConfig(palu_rank=64))
    assert KVCacheConfig(palu_rank=64).for_head_dim(64).head_dim == 64
    assert KVCacheConfig(palu_rank=8).for_head_dim(None).head_dim is None  # unknown: left to the cache
