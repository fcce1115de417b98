"""The pre-RoPE path: probing a model's RoPE, coding keys before it, positions through chunked
prefill / trim / save-load, the fallback warning, and install / uninstall leaving the model as it was."""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from kvspec import KVConfigError
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.models.rope_utils import Llama3RoPE, YarnRoPE
from palu_helpers import make_tiny_qwen3, planted_lowrank, rel_err
from palu_mlx import (
    KVCacheBuilder,
    KVCacheConfig,
    PaluKVCache,
    PreRopeFallbackWarning,
    Rotary,
    load_prompt_cache,
    save_prompt_cache,
)
from palu_mlx.rope import probe_rotary

HEAD_DIM = 32
FULL_RANK = dict(head_dim=HEAD_DIM, palu_rank=HEAD_DIM, palu_hi_bit=16, palu_lo_bit=16)


def greedy(model, prompt, steps, caches, **kw) -> list[int]:
    gen = generate_step(mx.array(prompt), model, max_tokens=steps, prompt_cache=caches, **kw)
    return [int(tok) for tok, _ in gen]


@pytest.mark.parametrize(
    "rope",
    [
        nn.RoPE(32, traditional=False, base=10000),
        nn.RoPE(32, traditional=True, base=500000),
        nn.RoPE(16, traditional=False, base=10000),  # partial rotary: the last 16 channels pass
        Llama3RoPE(
            32,
            max_position_embeddings=8192,
            base=500000,
            scaling_config={
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        ),
    ],
    ids=["half-split", "traditional", "partial-dims", "llama3-scaled"],
)
def test_probe_recovers_the_rotation_and_its_inverse(rope):
    rotary = probe_rotary(rope, 32)
    assert rotary is not None and rotary.dims == rope.dims
    x = mx.random.normal((1, 3, 5, 32), key=mx.random.key(1))
    for offset in (0, 9, 2047):
        assert rel_err(rotary.rotate(x, offset), rope(x, offset=offset)) < 1e-5
        assert rel_err(rotary.unrotate(rope(x, offset=offset), offset), x) < 1e-5


def test_probe_rejects_a_rope_that_scales_magnitudes():
    yarn = YarnRoPE(
        32, max_position_embeddings=4096, base=10000, scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.0
    )
    assert probe_rotary(yarn, 32) is None


def test_cache_codes_keys_before_rope():
    # keys of rank 4 before RoPE: RoPE spreads them over many directions, the cache undoes it
    rope = nn.RoPE(32, base=10000)
    pre = planted_lowrank((1, 4, 96, 32), rank=4, seed=3)
    rotated = rope(pre)
    values = planted_lowrank((1, 4, 96, 32), rank=4, seed=4)
    config = KVCacheConfig(
        method="palu", head_dim=32, palu_energy_threshold=0.999, palu_hi_bit=16, palu_lo_bit=16
    )
    post, pre_path = PaluKVCache(config), PaluKVCache(config, rotary=probe_rotary(rope, 32))
    for start in range(0, 96, 32):  # three chunks: fit on the first, project the others
        sl = slice(start, start + 32)
        k_post, _ = post.update_and_fetch(rotated[:, :, sl], values[:, :, sl])
        k_pre, _ = pre_path.update_and_fetch(rotated[:, :, sl], values[:, :, sl])
    assert pre_path.key_rank <= 5 < post.key_rank
    assert rel_err(k_pre, rotated) < 1e-4  # returned keys are rotated at their true positions


def test_rejects_a_rotary_of_another_type():
    with pytest.raises(KVConfigError, match="rotary"):
        PaluKVCache(KVCacheConfig(method="palu"), rotary="rope")


def test_for_model_gives_every_layer_its_rotary(tiny_model):
    caches = KVCacheBuilder.for_model(tiny_model, KVCacheConfig(method="palu", head_dim=HEAD_DIM))
    assert all(isinstance(c.rotary, Rotary) for c in caches)
    assert not hasattr(caches[0], "bits")  # mlx-lm would send it to its quantized attention
    assert "pre-RoPE" in repr(caches[0])
    off = KVCacheBuilder.for_model(
        tiny_model, KVCacheConfig(method="palu", head_dim=HEAD_DIM, palu_pre_rope=False)
    )
    assert all(c.rotary is None for c in off)


def test_full_rank_pre_rope_matches_kvcache_across_chunks_trim_and_save_load(tiny_model, tmp_path):
    model = tiny_model
    base = [KVCache() for _ in model.layers]
    palu = KVCacheBuilder.for_model(model, KVCacheConfig(**FULL_RANK))
    prompt = list(range(3, 103))
    # chunked prefill (40, 40, 19, 1), then 24 greedy steps
    first = greedy(model, prompt, 24, base, prefill_step_size=40)
    assert greedy(model, prompt, 24, palu, prefill_step_size=40) == first
    assert all(c.fitted and c.rotary is not None for c in palu)
    # trim 10 tokens from both: the next token's logits must match, so positions are right
    for b, p in zip(base, palu, strict=True):
        assert b.trim(10) == p.trim(10) == 10 and b.offset == p.offset
    probe = mx.array([[17]])
    assert rel_err(model(probe, cache=palu), model(probe, cache=base)) < 1e-4
    second = greedy(model, [5, 6, 7], 20, base)
    assert greedy(model, [5, 6, 7], 20, palu) == second
    path = str(tmp_path / "pre_rope.safetensors")
    save_prompt_cache(path, palu)
    loaded = load_prompt_cache(path)
    assert all(
        isinstance(c.rotary, Rotary) and c.offset == b.offset for c, b in zip(loaded, base, strict=True)
    )
    third = greedy(model, [9], 24, base)
    assert greedy(model, [9], 24, loaded) == third


def test_an_architecture_name_never_seen_takes_the_path_by_its_mechanism():
    # the decision probes the layers, not the name: qwen3's attention under another model_type
    model = make_tiny_qwen3(model_type="novelarch")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreRopeFallbackWarning)
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(**FULL_RANK))
    assert all(isinstance(c.rotary, Rotary) for c in caches)
    prompt = list(range(3, 60))
    assert greedy(model, prompt, 16, caches) == greedy(model, prompt, 16, [KVCache() for _ in model.layers])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off: no probe, no warning
        off = KVCacheBuilder.for_model(model, KVCacheConfig(**FULL_RANK, palu_pre_rope=False))
    assert all(c.rotary is None for c in off)


def test_install_then_uninstall_leaves_the_model_exactly_as_it_was():
    model = make_tiny_qwen3()
    params = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    tokens = mx.array([list(range(3, 40))])
    logits = model(tokens)
    KVCacheBuilder.install(model, KVCacheConfig(method="palu", head_dim=HEAD_DIM))
    KVCacheBuilder.install(
        model, KVCacheConfig(method="palu", head_dim=HEAD_DIM, palu_rank=4)
    )  # twice: no nesting
    assert isinstance(make_prompt_cache(model)[0], PaluKVCache)
    assert KVCacheBuilder.uninstall(model) is True
    assert KVCacheBuilder.uninstall(model) is False
    assert "make_cache" not in vars(model)
    assert all(type(c) is KVCache for c in make_prompt_cache(model))
    after = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    assert after.keys() == params.keys() and all(np.array_equal(after[k], params[k]) for k in params)
    assert mx.array_equal(model(tokens), logits).item()


def test_uninstall_restores_a_users_own_make_cache():
    model = make_tiny_qwen3()
    own = [KVCache() for _ in model.layers]

    def users_factory(*_a, **_k):
        return own

    model.make_cache = users_factory
    KVCacheBuilder.install(model, KVCacheConfig(method="palu", head_dim=HEAD_DIM))
    assert make_prompt_cache(model)[0] is not own[0]
    KVCacheBuilder.uninstall(model)
    assert model.make_cache is users_factory
