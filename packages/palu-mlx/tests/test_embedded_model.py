"""Generation with palu caches on the repository's embedded tiny qwen3 (fp32, head_dim 64, 4 KV heads /
8 query heads, located by ``embedded_model_path``). Skipped when the model is not present (an installed
package)."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx_lm
import palu_mlx.coders.hilo as hilo_module
import palu_mlx.coders.water_filling as water_filling_module
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from palu_mlx import KVCacheBuilder, KVCacheConfig

PROMPT = (
    "Return a new dictionary initialized from an optional positional argument and a possibly "
    "empty set of keyword arguments. If no positional argument is given, an empty dictionary is created."
)


@pytest.fixture(scope="module")
def embedded():
    # kvbench (palu-mlx's [compare] extra) knows where the model lives; a bare install has neither
    try:
        from kvbench.models import embedded_model_path

        path = embedded_model_path()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"embedded model not available: {exc}")
    model, tokenizer = mlx_lm.load(str(path))
    return model, tokenizer


def prompt_ids(tokenizer, min_tokens: int) -> list[int]:
    text = PROMPT
    while len(tokenizer.encode(text)) < min_tokens:
        text = text + " " + PROMPT
    return tokenizer.encode(text)


def greedy(model, prompt, steps, caches, **kw):
    return [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=steps, prompt_cache=caches, **kw)
    ]


@pytest.mark.slow
def test_full_rank_unquantized_matches_kvcache_for_64_greedy_steps(embedded):
    model, tokenizer = embedded
    head_dim = model.args.head_dim
    prompt = prompt_ids(tokenizer, 80)
    baseline = greedy(model, prompt, 64, [KVCache() for _ in model.layers])
    config = KVCacheConfig(head_dim=head_dim, palu_rank=head_dim, palu_hi_bit=16, palu_lo_bit=16)
    caches = KVCacheBuilder.for_model(model, config)
    assert greedy(model, prompt, 64, caches) == baseline
    assert all(c.fitted and c.key_rank == head_dim for c in caches)


@pytest.mark.slow
def test_defaults_generate_128_tokens_through_generate_and_stream_generate(embedded):
    model, tokenizer = embedded
    config = KVCacheConfig(method="palu", head_dim=model.args.head_dim)
    caches = KVCacheBuilder.for_model(model, config)
    prompt = prompt_ids(tokenizer, 80)
    mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=128, prompt_cache=caches)
    assert caches[0].offset == len(prompt) + 128 and all(c.fitted for c in caches)
    logits = model(mx.array([[5]]), cache=caches)
    assert mx.all(mx.isfinite(logits)).item()
    stats = [c.storage_stats() for c in caches]
    bits = 8 * sum(s.nbytes for s in stats) / sum(s.elements for s in stats)
    print(f"\npalu defaults after generate: effective {bits:.3f} bits per K/V element (measured nbytes)")

    caches = KVCacheBuilder.for_model(model, config)
    responses = list(
        mlx_lm.stream_generate(model, tokenizer, prompt=prompt, max_tokens=128, prompt_cache=caches)
    )
    assert len(responses) == 128
    assert all(mx.all(mx.isfinite(r.logprobs)).item() for r in responses)
    stats = [c.storage_stats() for c in caches]
    bits = 8 * sum(s.nbytes for s in stats) / sum(s.elements for s in stats)
    print(f"palu defaults after stream_generate: effective {bits:.3f} bits per K/V element")
    assert bits < 16 and math.isfinite(bits)


@pytest.mark.slow
def test_prompt_longer_than_one_prefill_chunk(embedded, monkeypatch):
    model, tokenizer = embedded
    head_dim = model.args.head_dim
    fits = []
    real_fit = hilo_module.fit_group_projection
    for module in (hilo_module, water_filling_module):  # the split's fit, then the bit budget's
        monkeypatch.setattr(
            module, "fit_group_projection", lambda x, *a: fits.append(x.shape[2]) or real_fit(x, *a)
        )
    prompt = prompt_ids(tokenizer, 300)
    full = KVCacheConfig(head_dim=head_dim, palu_rank=head_dim, palu_hi_bit=16, palu_lo_bit=16)
    baseline = greedy(model, prompt, 16, [KVCache() for _ in model.layers], prefill_step_size=128)
    assert greedy(model, prompt, 16, KVCacheBuilder.for_model(model, full), prefill_step_size=128) == baseline
    # fitted once per layer and tensor, on the first 128-token chunk; later chunks were projected
    assert fits == [128] * (2 * len(model.layers))
    fits.clear()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="palu", head_dim=head_dim))
    gen = generate_step(mx.array(prompt), model, max_tokens=16, prompt_cache=caches, prefill_step_size=128)
    assert all(mx.all(mx.isfinite(lp)).item() for _, lp in gen)
    assert fits == [128] * (2 * len(model.layers)) and caches[0].offset == len(prompt) + 16


@pytest.mark.slow
def test_pre_rope_full_rank_matches_kvcache_for_64_steps_across_chunks_trim_and_save_load(embedded, tmp_path):
    from palu_mlx import load_prompt_cache, save_prompt_cache

    model, tokenizer = embedded
    head_dim = model.args.head_dim
    config = KVCacheConfig(head_dim=head_dim, palu_rank=head_dim, palu_hi_bit=16, palu_lo_bit=16)
    base = [KVCache() for _ in model.layers]
    palu = KVCacheBuilder.for_model(model, config)
    assert all(c.rotary is not None for c in palu)
    prompt = prompt_ids(tokenizer, 200)
    steps = []
    first = greedy(model, prompt, 24, base, prefill_step_size=64)  # chunked prefill
    assert greedy(model, prompt, 24, palu, prefill_step_size=64) == first
    steps += first
    for b, p in zip(base, palu, strict=True):
        assert b.trim(16) == p.trim(16) == 16 and b.offset == p.offset
    probe = mx.array([first[0:1]])
    diff = mx.abs(model(probe, cache=palu) - model(probe, cache=base)).max().item()
    assert diff < 1e-3  # the next position after trim sees the right positions
    second = greedy(model, first[-8:], 20, base)
    assert greedy(model, first[-8:], 20, palu) == second
    steps += second
    path = str(tmp_path / "embedded.safetensors")
    save_prompt_cache(path, palu)
    loaded = load_prompt_cache(path)
    third = greedy(model, second[-1:], 20, base)
    assert greedy(model, second[-1:], 20, loaded) == third
    steps += third
    assert len(steps) == 64


@pytest.mark.slow
def test_pre_rope_keys_need_a_lower_rank_than_post_rope_keys(embedded):
    model, tokenizer = embedded
    head_dim = model.args.head_dim
    prompt = mx.array(prompt_ids(tokenizer, 256))
    ranks = {}
    for pre_rope in (False, True):
        config = KVCacheConfig(head_dim=head_dim, palu_n_head_groups=4, palu_pre_rope=pre_rope)
        caches = KVCacheBuilder.for_model(model, config)
        model(prompt[None], cache=caches)
        ranks[pre_rope] = [c.key_rank for c in caches]
    print(f"\n90%-energy key rank per layer (4 groups): post-RoPE {ranks[False]}, pre-RoPE {ranks[True]}")
    assert sum(ranks[True]) < sum(ranks[False])
