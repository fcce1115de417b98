"""mlx-lm wiring on a tiny seeded random-weight qwen3: builder, generation paths, save / load."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import palu_mlx.coders.water_filling as fitting_module
import pytest
from kvspec import KVConfigError
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache
from palu_helpers import make_tiny_qwen3
from palu_mlx import (
    KVCacheBuilder,
    KVCacheConfig,
    NaiveQuantKVCache,
    PaluKVCache,
    load_prompt_cache,
    save_prompt_cache,
)

HEAD_DIM = 32  # the tiny model's head dim (4 KV heads, 8 query heads)
FULL_RANK = dict(palu_rank=HEAD_DIM, palu_hi_bit=16, palu_lo_bit=16)


def greedy(model, prompt, steps, caches, **kw) -> list[int]:
    gen = generate_step(mx.array(prompt), model, max_tokens=steps, prompt_cache=caches, **kw)
    return [int(tok) for tok, _ in gen]


@pytest.fixture
def tokenizer():
    """A word-level tokenizer over the tiny model's 256 ids ("w0" ... "w255"), built in memory."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", bos_token="w2"))


def test_for_model_builds_one_palu_cache_per_layer(tiny_model):
    caches = KVCacheBuilder.for_model(tiny_model, KVCacheConfig(method="palu", head_dim=HEAD_DIM))
    assert len(caches) == 2 and all(isinstance(c, PaluKVCache) for c in caches)
    assert caches[0] is not caches[1]
    naive = KVCacheBuilder.for_model(
        tiny_model, KVCacheConfig(method="naive", head_dim=HEAD_DIM, naive_group_size=32)
    )
    assert all(isinstance(c, NaiveQuantKVCache) for c in naive)


def test_for_model_rejects_wrong_head_dim_and_groups(tiny_model):
    with pytest.raises(KVConfigError, match="head_dim=64"):
        KVCacheBuilder.for_model(tiny_model, KVCacheConfig(method="palu", head_dim=64))
    with pytest.raises(KVConfigError, match="palu_n_head_groups=3"):
        KVCacheBuilder.for_model(
            tiny_model, KVCacheConfig(method="palu", head_dim=HEAD_DIM, palu_n_head_groups=3)
        )


def test_full_rank_unquantized_reproduces_kvcache_greedy_tokens(tiny_model):
    prompt = list(range(3, 43))  # 40 tokens: the fit happens at the prefill
    baseline = greedy(tiny_model, prompt, 48, [KVCache() for _ in range(2)])
    caches = KVCacheBuilder.for_model(
        tiny_model, KVCacheConfig(method="palu", head_dim=HEAD_DIM, **FULL_RANK)
    )
    assert greedy(tiny_model, prompt, 48, caches) == baseline
    assert all(c.fitted for c in caches)


def test_fit_during_decode_keeps_full_rank_tokens(tiny_model):
    prompt = [5, 9, 11]  # a 3-token prompt: exact until 32 tokens, then fit mid-decode
    baseline = greedy(tiny_model, prompt, 40, [KVCache() for _ in range(2)])
    caches = KVCacheBuilder.for_model(
        tiny_model, KVCacheConfig(method="palu", head_dim=HEAD_DIM, **FULL_RANK)
    )
    assert greedy(tiny_model, prompt, 40, caches) == baseline
    assert caches[0].fitted and caches[0].key_rank == HEAD_DIM


def test_default_config_generates_finite_logits(tiny_model):
    caches = KVCacheBuilder.for_model(tiny_model, KVCacheConfig(method="palu", head_dim=HEAD_DIM))
    gen = generate_step(mx.array(list(range(3, 50))), tiny_model, max_tokens=40, prompt_cache=caches)
    for token, logprobs in gen:
        assert 0 <= int(token) < 256 and mx.all(mx.isfinite(logprobs)).item()
    # 47 prompt tokens, then mlx-lm feeds each of the 40 generated tokens back, the last one too
    assert caches[0].offset == 47 + 40
    # float32 K/V: 32 bits per element uncompressed; at 87 tokens the per-sequence projections,
    # the 256-token buffer and the exact first and newest tokens dominate, yet it holds less
    assert caches[0].storage_stats().bits_per_element < 32


def test_chunked_prefill_fits_once_then_projects(tiny_model, monkeypatch):
    fits = []
    real_fit = fitting_module.fit_group_projection
    monkeypatch.setattr(
        fitting_module, "fit_group_projection", lambda x, *a: fits.append(x.shape) or real_fit(x, *a)
    )
    caches = KVCacheBuilder.for_model(tiny_model, KVCacheConfig(method="palu", head_dim=HEAD_DIM))
    tokens = greedy(tiny_model, list(range(3, 103)), 5, caches, prefill_step_size=40)  # chunks 40, 40, 19, 1
    assert len(tokens) == 5 and caches[0].offset == 105
    # one fit of keys and one of values per layer, on the first 40-token chunk only
    assert fits == [(1, 4, 40, HEAD_DIM)] * 4


def test_install_make_cache_gives_fresh_palu_caches(tiny_model):
    model = make_tiny_qwen3()
    factory = KVCacheBuilder.install(model, KVCacheConfig(method="palu", head_dim=HEAD_DIM))
    first, second = make_prompt_cache(model), make_prompt_cache(model)
    assert all(isinstance(c, PaluKVCache) for c in first) and first[0] is not second[0]
    assert factory is model.make_cache
    KVCacheBuilder.install(
        model, KVCacheConfig(method="palu", head_dim=HEAD_DIM, palu_rank=4)
    )  # re-install does not nest
    assert make_prompt_cache(model)[0].config.palu_rank == 4
    assert len(greedy(model, list(range(3, 40)), 4, None)) == 4  # generate_step builds its own cache


def test_make_cache_lambda_returning_prebuilt_caches(tiny_model):
    model = make_tiny_qwen3()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="palu", head_dim=HEAD_DIM))
    model.make_cache = lambda *_a, **_k: caches
    assert make_prompt_cache(model) is caches
    greedy(model, list(range(3, 40)), 3, None)
    assert caches[0].offset == 37 + 3


def test_generate_and_stream_generate_accept_palu_prompt_cache(tiny_model, tokenizer):
    caches = KVCacheBuilder.for_model(tiny_model, KVCacheConfig(method="palu", head_dim=HEAD_DIM))
    text = mlx_lm.generate(
        tiny_model, tokenizer, prompt=list(range(3, 60)), max_tokens=12, prompt_cache=caches
    )
    assert len(text.split()) == 12 and caches[0].offset == 57 + 12
    responses = list(
        mlx_lm.stream_generate(
            tiny_model, tokenizer, prompt=list(range(3, 10)), max_tokens=6, prompt_cache=caches
        )
    )
    assert len(responses) == 6 and responses[-1].finish_reason == "length"
    assert caches[0].offset == 69 + 7 + 6


@pytest.mark.parametrize("fitted", [False, True], ids=["exact", "latent"])
def test_prompt_cache_save_load_round_trip(tiny_model, tmp_path, fitted):
    prompt = list(range(3, 50 if fitted else 20))
    caches = KVCacheBuilder.for_model(tiny_model, KVCacheConfig(method="palu", head_dim=HEAD_DIM))
    greedy(tiny_model, prompt, 1, caches)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches, {"prompt": "test"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"prompt": "test"}
    for a, b in zip(caches, loaded, strict=True):
        assert type(b) is PaluKVCache and a.offset == b.offset and a.meta_state == b.meta_state
        assert a.state.keys() == b.state.keys()
        assert all(mx.array_equal(a.state[k], b.state[k]).item() for k in a.state)
    assert greedy(tiny_model, [7], 12, loaded) == greedy(tiny_model, [7], 12, caches)


def test_save_load_mixed_with_mlx_lm_caches(tiny_model, tmp_path):
    caches = [KVCache(), PaluKVCache(KVCacheConfig(method="palu", head_dim=HEAD_DIM, palu_min_fit_tokens=8))]
    greedy(tiny_model, list(range(3, 30)), 1, caches)
    path = str(tmp_path / "mixed.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert type(loaded[0]) is KVCache and loaded[0].offset == caches[0].offset
    assert greedy(tiny_model, [7], 8, loaded) == greedy(tiny_model, [7], 8, caches)


def test_load_rejects_foreign_files(tmp_path):
    path = str(tmp_path / "other.safetensors")
    mx.save_safetensors(path, {"x": mx.zeros(2)})
    with pytest.raises(KVConfigError, match="not a palu-mlx prompt cache"):
        load_prompt_cache(path)
