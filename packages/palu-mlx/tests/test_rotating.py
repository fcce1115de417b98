"""RotatingPaluKVCache against mlx-lm's RotatingKVCache: what attention sees, masks, trim, files,
bounded bytes, bad input, the builder, ``palu-mlx generate --max-kv-size`` and the server's
prompt cache."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.models.cache import load_prompt_cache as mlx_load_prompt_cache
from mlx_lm.models.cache import save_prompt_cache as mlx_save_prompt_cache
from palu_mlx import (
    KVCacheBuilder,
    KVCacheConfig,
    PaluKVCache,
    Rotary,
    RotatingPaluKVCache,
    load_prompt_cache,
    rotation_code,
    save_prompt_cache,
)
from palu_mlx.rotating import HeldRotary
from test_pre_rope_families import COMMON, build_family

D, H = 16, 2
#: full rank, 16-bit latents: coding loses nothing but float32 rounding
LOSSLESS = dict(head_dim=D, palu_rank=D, palu_hi_bit=16, palu_lo_bit=16)
ROTARY = Rotary(
    inv_freq=1.0 / (100.0 ** (mx.arange(0, D, 2, dtype=mx.float32) / D)), dims=D, traditional=False
)
#: prefill chunks then decode steps, crossing windows of 8 and 16 several times over
CHUNKS = [7, 1, 1, 30, *[1] * 20, 5, 17, *[1] * 12, 40, 1, 3, *[1] * 9]
GEMMA = {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16, "sliding_window_pattern": 2}
FULL_RANK = dict(palu_rank=32, palu_hi_bit=16, palu_lo_bit=16)


def rotating(max_size: int, keep: int = 0, **config) -> RotatingPaluKVCache:
    return RotatingPaluKVCache(
        PaluKVCache(KVCacheConfig(**{**LOSSLESS, **config}), rotary=ROTARY), max_size, keep
    )


def same_rotary(a: HeldRotary, b: HeldRotary) -> bool:
    return (a.dims, a.traditional, a.keep, a.shift) == (b.dims, b.traditional, b.keep, b.shift) and bool(
        mx.array_equal(a.inv_freq, b.inv_freq)
    )


def token_rows(offset: int, s: int, seed: int) -> tuple[mx.array, mx.array]:
    """Keys rotated at positions ``offset + i`` (as a model hands them over) and values."""
    k = mx.random.normal((1, H, s, D), key=mx.random.key(seed))
    v = mx.random.normal((1, H, s, D), key=mx.random.key(seed + 10_000))
    return ROTARY.rotate(k, offset), v


def attend(cache, keys, values, queries, window_size=None) -> mx.array:
    mask = cache.make_mask(queries.shape[2], window_size=window_size)
    k, v = cache.update_and_fetch(keys, values)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=D**-0.5, mask=mask)


def run_both(ours, theirs, chunks, window_size=None, seed=0):
    """Feed both caches the same chunks; yields (chunk, our output, their output) per call."""
    for i, s in enumerate(chunks):
        keys, values = token_rows(theirs.offset, s, seed + i)
        queries = mx.random.normal((1, 2 * H, s, D), key=mx.random.key(seed + 20_000 + i))
        a = attend(ours, keys, values, queries, window_size)
        b = attend(theirs, keys, values, queries, window_size)
        yield s, a, b


# --------------------------------------------------------------------------- what attention sees
@pytest.mark.parametrize("max_size,keep", [(16, 0), (16, 4), (8, 2), (5, 4)])
def test_attention_sees_what_rotating_kv_cache_gives(max_size, keep):
    ours, theirs = rotating(max_size, keep), RotatingKVCache(max_size=max_size, keep=keep)
    for s, a, b in run_both(ours, theirs, CHUNKS):
        assert a.shape == b.shape
        assert mx.allclose(a, b, atol=1e-4).item(), (s, ours.offset)
        assert ours.offset == theirs.offset and ours.size() == theirs.size()
    assert ours.fitted and ours.rotary.shift > 0  # rows were dropped and the positions followed


def test_a_window_narrower_than_the_cache_masks_decode_steps_as_rotating_kv_cache():
    ours, theirs = rotating(16), RotatingKVCache(max_size=16)
    for _, a, b in run_both(ours, theirs, [20, *[1] * 30], window_size=6):
        assert mx.allclose(a, b, atol=1e-4).item()


@pytest.mark.parametrize("max_size,keep", [(16, 0), (8, 4)])
def test_masks_match_rotating_kv_cache_also_for_prefill_chunks_longer_than_the_window(max_size, keep):
    ours, theirs = rotating(max_size, keep), RotatingKVCache(max_size=max_size, keep=keep)
    for s in [3, 1, 25, 1, 1, 40, 2]:
        for n in (1, 2, max_size - 1, max_size, 3 * max_size):
            for return_array in (False, True):
                got = ours.make_mask(n, return_array=return_array)
                want = theirs.make_mask(n, return_array=return_array)
                if isinstance(want, mx.array):
                    assert isinstance(got, mx.array) and mx.array_equal(got, want).item()
                else:
                    assert got == want
        keys, values = token_rows(theirs.offset, s, s)
        ours.update_and_fetch(keys, values)
        theirs.update_and_fetch(keys, values)


def test_a_lossy_cache_returns_the_kept_and_newest_rows_exactly():
    # 2-bit codes: the sink rows (the first ``keep``) and the recent window must still come back
    # as given, also after rows were dropped between them
    ours = rotating(
        24, 4, palu_rank=None, palu_hi_bit=None, palu_lo_bit=None, palu_bits=2, palu_recent_tokens=6
    )
    given_k, given_v = [], []
    for i, s in enumerate([30, *[1] * 40, 9, *[1] * 5]):
        keys, values = token_rows(ours.offset, s, i)
        given_k.append(keys)
        given_v.append(values)
        k, v = ours.update_and_fetch(keys, values)
        all_k, all_v = mx.concatenate(given_k, axis=2), mx.concatenate(given_v, axis=2)
        n = k.shape[2]
        assert n == (ours.offset if ours.offset - s < 24 else 23 + s)
        assert mx.array_equal(k[..., :4, :], all_k[..., :4, :]).item()
        assert mx.array_equal(v[..., -6:, :], all_v[..., -6:, :]).item()
        assert mx.array_equal(k[..., -6:, :], all_k[..., -6:, :]).item()
        # the coded rows between are the right tokens: closer to them than to their neighbours
        if ours.offset >= 24 and n > 12:
            mid = all_k[..., ours.offset - n + 4 : ours.offset - 6, :]
            err = mx.abs(k[..., 4:-6, :] - mid).mean().item()
            off_by_one = mx.abs(k[..., 5:-6, :] - mid[..., :-1, :]).mean().item()
            assert err < 0.7 * off_by_one


# --------------------------------------------------------------------------- on a model
def greedy(model, prompt, caches, steps=24, prefill_step_size=2048) -> list[int]:
    gen = generate_step(
        mx.array(prompt), model, max_tokens=steps, prompt_cache=caches, prefill_step_size=prefill_step_size
    )
    return [int(t) for t, _ in gen]


@pytest.fixture
def fitted_windows(monkeypatch):
    """Every window fitted, however short: the tests of the rotating semantics compare a lossless
    fitted code with mlx-lm token for token (short windows otherwise take the 4-bit rotation code)."""
    monkeypatch.setattr(rotation_code, "FIT_WINDOW_PER_DIM", 0)


@pytest.fixture(scope="module")
def gemma():
    return build_family("gemma3_text", COMMON, GEMMA)


@pytest.mark.parametrize("prefill_step_size", [2048, 23, 5])
def test_greedy_tokens_of_a_tiny_gemma3_equal_mlx_lm_with_a_window_shorter_than_the_prompt(
    gemma, prefill_step_size, fitted_windows
):
    prompt = list(range(3, 73))  # 70 tokens, windows of 16
    caches = KVCacheBuilder.for_model(gemma, KVCacheConfig(**FULL_RANK))
    assert [type(c) for c in caches] == [RotatingPaluKVCache, PaluKVCache]
    assert (caches[0].max_size, caches[0].keep) == (16, 0)
    want = greedy(gemma, prompt, make_prompt_cache(gemma), prefill_step_size=prefill_step_size)
    assert greedy(gemma, prompt, caches, prefill_step_size=prefill_step_size) == want
    assert caches[0].cache.offset < 16 + caches[0].slack <= caches[0].offset


def test_mixed_llama_layers_and_max_kv_size_equal_mlx_lm(fitted_windows):
    model = build_family(
        "llama", COMMON, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 12}
    )
    prompt = list(range(3, 60))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**FULL_RANK))
    assert [type(c) for c in caches] == [RotatingPaluKVCache, PaluKVCache]
    assert greedy(model, prompt, caches) == greedy(model, prompt, make_prompt_cache(model))
    # every layer bounded, as mlx-lm bounds a model without make_cache (keeping the first 4)
    plain = build_family("llama", COMMON, {})
    bounded = KVCacheBuilder.for_model(plain, KVCacheConfig(**FULL_RANK), max_kv_size=20)
    assert all(type(c) is RotatingPaluKVCache and (c.max_size, c.keep) == (20, 4) for c in bounded)
    # what make_prompt_cache(model, max_kv_size=20) gives a model without its own make_cache
    want = greedy(plain, prompt, [RotatingKVCache(max_size=20, keep=4) for _ in plain.layers])
    assert greedy(plain, prompt, bounded) == want


def test_the_default_config_codes_sliding_layers_and_stays_bounded(gemma):
    caches = KVCacheBuilder.for_model(gemma, KVCacheConfig())
    sliding = caches[0]
    gen = generate_step(mx.array(list(range(3, 200))), gemma, max_tokens=300, prompt_cache=caches)
    sizes = []
    for _ in gen:
        sizes.append(sliding.nbytes)
        assert sliding.cache.offset <= sliding.max_size - 1 + sliding.slack
    assert sliding.fitted and sliding.offset == 197 + 300
    # bounded: no more bytes over the last 150 tokens than over the 150 before
    assert max(sizes[150:]) <= max(sizes[:150])
    # the code rows held: the window and the slack, whatever the length
    assert all(b.shape[2] <= sliding.max_size + 2 * sliding.slack for b in sliding.cache._key_codes.values())
    assert sliding.nbytes < caches[1].nbytes  # the full-attention layer codes all 497 tokens


# --------------------------------------------------------------------------- trim
def test_trim_as_rotating_kv_cache():
    ours, theirs = rotating(16), RotatingKVCache(max_size=16)
    for _ in run_both(ours, theirs, [9, 1, 1]):
        pass
    assert ours.is_trimmable() and theirs.is_trimmable()
    assert ours.trim(3) == theirs.trim(3) == 3
    assert ours.offset == theirs.offset == 8
    for _, a, b in run_both(ours, theirs, [1, 1, 4, 1], seed=50):
        assert mx.allclose(a, b, atol=1e-4).item()
    for _ in run_both(ours, theirs, [1] * 6, seed=60):
        pass
    assert ours.offset >= 16 and not ours.is_trimmable() and not theirs.is_trimmable()
    before = (ours.offset, ours.cache.offset, ours.nbytes)
    with pytest.raises(KVConfigError, match="is_trimmable"):
        ours.trim(2)
    assert (ours.offset, ours.cache.offset, ours.nbytes) == before
    assert ours.trim(0) == 0
    caches = [ours, KVCache()]
    assert not can_trim_prompt_cache(caches) and trim_prompt_cache(caches, 2) == 0


# --------------------------------------------------------------------------- files and copies
def _continued(model, caches, tokens) -> list[int]:
    return greedy(model, tokens, caches, steps=8)


def test_save_and_load_through_mlx_lm_and_palu_files(gemma, tmp_path):
    caches = KVCacheBuilder.for_model(gemma, KVCacheConfig())
    greedy(gemma, list(range(3, 90)), caches, steps=20)
    assert caches[0].cache.offset < caches[0].offset  # rows were dropped before saving
    want = _continued(gemma, copy.deepcopy(caches), [7, 8, 9])

    mlx_save_prompt_cache(str(tmp_path / "mlx.safetensors"), caches, {"k": "v"})
    loaded, meta = mlx_load_prompt_cache(str(tmp_path / "mlx.safetensors"), return_metadata=True)
    assert meta == {"k": "v"} and type(loaded[0]) is RotatingPaluKVCache
    assert (loaded[0].offset, loaded[0].max_size, loaded[0].keep) == (caches[0].offset, 16, 0)
    assert same_rotary(loaded[0].rotary, caches[0].rotary)
    for a, b in zip(loaded[0].state.values(), caches[0].state.values(), strict=True):
        assert mx.array_equal(a, b).item()
    assert _continued(gemma, loaded, [7, 8, 9]) == want

    save_prompt_cache(str(tmp_path / "palu"), caches)
    assert _continued(gemma, load_prompt_cache(str(tmp_path / "palu")), [7, 8, 9]) == want
    assert _continued(gemma, caches, [7, 8, 9]) == want  # saving left the caches as they were


def test_the_server_prompt_cache_reuses_rotating_caches(gemma, fitted_windows):
    # what mlx-lm's server does with a conversation's caches: keep them, hand out deep copies,
    # trim a copy back to a shared prefix where every layer allows it
    lru = LRUPromptCache(max_size=4)
    first = list(range(3, 40))
    caches = KVCacheBuilder.for_model(gemma, KVCacheConfig(**FULL_RANK))
    reply = greedy(gemma, first, caches, steps=6)
    history = first + reply  # generate_step has fed every token it yielded
    lru.insert_cache("m", history, caches)
    second = history + [11, 12, 13]
    found, rest = lru.fetch_nearest_cache("m", second)
    assert found is not caches and rest == [11, 12, 13]
    mlx_lm_caches = make_prompt_cache(gemma)
    greedy(gemma, first, mlx_lm_caches, steps=6)
    assert greedy(gemma, rest, found, steps=6) == greedy(gemma, rest, mlx_lm_caches, steps=6)
    # the kept entry was not changed by the follow-up
    assert caches[0].offset == len(history)


# --------------------------------------------------------------------------- bad input
def test_bad_arguments_raise_kvspec_errors():
    fresh = PaluKVCache(KVCacheConfig(**LOSSLESS))
    for bad in [dict(max_size=0), dict(max_size=8, keep=8), dict(max_size=True), dict(max_size=8, keep=-1)]:
        with pytest.raises(KVConfigError, match="max_size|keep"):
            RotatingPaluKVCache(fresh, **bad)
    with pytest.raises(KVConfigError, match="PaluKVCache"):
        RotatingPaluKVCache(KVCache(), 8)
    used = PaluKVCache(KVCacheConfig(**LOSSLESS))
    used.update_and_fetch(*token_rows(0, 3, 0))
    with pytest.raises(KVConfigError, match="empty"):
        RotatingPaluKVCache(used, 8)
    cache = rotating(8)
    with pytest.raises(KVShapeError):
        cache.make_mask(0)
    with pytest.raises(KVConfigError):
        cache.make_mask(2, window_size=0)
    model = build_family("llama", COMMON, {})
    for bad in (4, 0, True, 2.5):
        with pytest.raises(KVConfigError, match="max_kv_size"):
            KVCacheBuilder.for_model(model, KVCacheConfig(), max_kv_size=bad)
    with pytest.raises(KVConfigError, match="method='palu'"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="naive"), max_kv_size=16)


def test_a_bad_update_leaves_the_cache_unchanged():
    cache = rotating(8, 2)
    for i, s in enumerate([20, 1, 1, 1]):
        cache.update_and_fetch(*token_rows(cache.offset, s, i))
    before = (cache.offset, cache.cache.offset, cache.rotary, json.dumps(cache.meta_state))
    keys, values = token_rows(cache.offset, 1, 99)
    with pytest.raises(KVDtypeError):
        cache.update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))
    with pytest.raises(KVShapeError):
        cache.update_and_fetch(keys[:, :1], values[:, :1])
    with pytest.raises(KVDtypeError):
        cache.update_and_fetch(np.zeros((1, H, 1, D)), values)
    assert (cache.offset, cache.cache.offset, cache.rotary, json.dumps(cache.meta_state)) == before


def _meta_with(cache, **changes):
    settings, runtime = cache.meta_state
    runtime = json.loads(runtime)
    runtime.update(changes)
    return settings, json.dumps(runtime)


def test_a_bad_state_raises_kv_data_error_naming_it():
    cache = rotating(8, 2)
    for i, s in enumerate([20, 1, 1, 1, 1, 1, 1]):
        cache.update_and_fetch(*token_rows(cache.offset, s, i))
    assert cache.cache.offset < cache.offset
    arrays = {k: v for k, v in cache.state.items() if k != "meta_state"}
    back = RotatingPaluKVCache.from_state(arrays, cache.meta_state)
    assert back.offset == cache.offset and same_rotary(back.rotary, cache.rotary)
    cases = {
        "max_size": dict(max_size=0),
        "keep": dict(keep=8),
        "offset": dict(offset=-1),
        "rows held": dict(offset=cache.offset + 5000, max_size=10_000),
        "inner": dict(inner={"class": "KVCache", "runtime": "{}"}),
        "class": dict(**{"class": "PaluKVCache"}),
    }
    for name, change in cases.items():
        with pytest.raises(KVDataError, match=name.split()[0]):
            RotatingPaluKVCache.from_state(arrays, _meta_with(cache, **change))
    dropped = max(k for k in arrays if k.startswith("key."))
    with pytest.raises(KVDataError, match=dropped):
        RotatingPaluKVCache.from_state({k: v for k, v in arrays.items() if k != dropped}, cache.meta_state)
    state = cache.state
    state["meta_state"] = mx.array(np.frombuffer(b"not json", dtype=np.uint8))
    with pytest.raises(KVDataError, match="meta_state"):
        RotatingPaluKVCache.from_state(state)


def test_held_rotary_rotates_rows_at_their_tokens_positions():
    held = HeldRotary.of(ROTARY, keep=3, shift=10)
    x = mx.random.normal((1, H, 8, D), key=mx.random.key(5))
    want = mx.concatenate([ROTARY.rotate(x[..., :3, :], 0), ROTARY.rotate(x[..., 3:, :], 13)], axis=2)
    assert mx.allclose(held.rotate(x, 0), want, atol=1e-5).item()
    assert mx.allclose(held.unrotate(held.rotate(x, 0), 0), x, atol=1e-5).item()
    assert mx.allclose(held.rotate(x[..., 4:, :], 4), ROTARY.rotate(x[..., 4:, :], 14), atol=1e-5).item()


# --------------------------------------------------------------------------- palu-mlx generate
MODEL = os.environ.get("KVBENCH_EMBEDDED_MODEL") or str(
    Path(__file__).resolve().parents[3] / "benchmarks" / "model" / "tiny-qwen3"
)


@pytest.mark.skipif(not os.path.isdir(MODEL), reason="the embedded model is not checked out")
def test_generate_max_kv_size_bounds_every_layer(capsys, tmp_path):
    from palu_mlx.generate import generate_main

    prompt = "The json module encodes Python objects as strings and decodes them back. " * 6
    args = ["--model", MODEL, "--prompt", prompt, "--max-tokens", "12", "--verbose", "True"]
    assert generate_main([*args, "--max-kv-size", "32"]) == 0
    out = capsys.readouterr().out
    held = re.search(r"KV cache: ([\d.]+) MB held for (\d+) tokens", out)
    assert held and int(held.group(2)) == 32
    assert generate_main(args) == 0
    full = re.search(r"KV cache: ([\d.]+) MB held for (\d+) tokens", capsys.readouterr().out)
    assert int(full.group(2)) > 64 and float(held.group(1)) < float(full.group(1))
    assert generate_main([*args, "--max-kv-size", "4"]) == 1
    assert "max_kv_size" in capsys.readouterr().err
    file = str(tmp_path / "c.safetensors")
    assert generate_main([*args, "--max-kv-size", "32", "--prompt-cache-file", file]) == 1
    assert "--prompt-cache-file" in capsys.readouterr().err


# --------------------------------------------------------------------------- the server
def _sliding_model_dir(path: Path) -> Path:
    """A tiny random llama whose first layer slides (window 8), with the embedded model's tokenizer."""
    import shutil

    from mlx.utils import tree_flatten

    config = {
        **COMMON,
        "model_type": "llama",
        "vocab_size": 4096,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
    }
    model = build_family("llama", config, {})
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(MODEL) / name, path / name)
    return path


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(MODEL), reason="the embedded model's tokenizer is not checked out")
def test_a_served_model_with_sliding_layers_answers_two_turns(tmp_path):
    from palu_helpers import palu_server

    openai = pytest.importorskip("openai")
    pytest.importorskip("kvbench.process")
    model_dir = _sliding_model_dir(tmp_path / "sliding")
    log = tmp_path / "server.log"
    with palu_server(str(model_dir), log, "--max-tokens", "12") as port:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        messages = [{"role": "user", "content": "Explain lists and tuples in Python, please."}]
        # a random model's reply need not tokenize back to the tokens it generated, and a cache whose
        # window has slid cannot be trimmed back to the common prefix (as mlx-lm's own): the
        # follow-up may be computed afresh, but it must be answered
        for _ in range(2):
            reply = client.chat.completions.create(
                model="default_model", messages=messages, max_tokens=12, temperature=0.0
            )
            assert reply.choices[0].message.content is not None and reply.usage.completion_tokens > 0
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "And a short example?"},
            ]
    assert "one request at a time (RotatingPaluKVCache cannot be batched)" in log.read_text()
