"""Saving a transformers cache losslessly (``flashcodec.hf.saved``): bit for bit, fewer bytes, and
generation from the loaded cache gives the uninterrupted run's tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import tiny_qwen3  # noqa: E402
from flashcodec.hf.saved import cache_from_bytes, cache_to_bytes, load_cache, save_cache  # noqa: E402
from kvspec import KVConfigError, KVDataError, KVDtypeError  # noqa: E402
from transformers import DynamicCache  # noqa: E402


def tiny(dtype):
    return tiny_qwen3(dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_saved_cache_round_trips_and_generation_continues_identically(dtype, tmp_path):
    model = tiny(dtype)
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, cache=DynamicCache(config=model.config), **greedy)
        cache = DynamicCache(config=model.config)
        model(ids[:, :-1], cache=cache)
    path = tmp_path / "prompt.fckv"
    written = save_cache(cache, path)
    raw = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert written == path.stat().st_size
    if dtype == torch.bfloat16:  # fp16's three extra mantissa bits are close to random
        assert written < 0.85 * raw, written / raw
    loaded = load_cache(path, config=model.config)
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        assert torch.equal(a.keys.view(torch.int16), b.keys.view(torch.int16))
        assert torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))
    with torch.no_grad():
        got = model.generate(ids, cache=loaded, **greedy)
    assert torch.equal(got, want)


def test_a_cache_without_config_and_an_empty_layer():
    k = torch.randn(1, 2, 9, 8).to(torch.bfloat16)
    cache = DynamicCache()
    cache.update(k, -k, 0)
    cache.update(2 * k, k, 1)
    back = cache_from_bytes(cache_to_bytes(cache, group=8, level=1))
    assert torch.equal(back.layers[1].keys, 2 * k) and torch.equal(back.layers[0].values, -k)
    empty = DynamicCache(config=tiny(torch.bfloat16).config)
    empty.update(k, k, 1)  # layer 0 never written
    again = cache_from_bytes(cache_to_bytes(empty), config=tiny(torch.bfloat16).config)
    assert again.layers[0].get_seq_length() == 0 and torch.equal(again.layers[1].keys, k)


def test_bad_caches_and_bytes_are_rejected():
    cache = DynamicCache()
    cache.update(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), 0)  # float32
    with pytest.raises(KVDtypeError, match="bfloat16 or float16"):
        cache_to_bytes(cache)
    with pytest.raises(KVConfigError, match="Cache"):
        cache_to_bytes(object())
    with pytest.raises(KVDataError, match="magic"):
        cache_from_bytes(b"something else")
    with pytest.raises(KVDtypeError):
        cache_from_bytes("text")
