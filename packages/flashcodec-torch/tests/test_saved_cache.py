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


@pytest.mark.parametrize("coder", ["exponent", "context"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_saved_cache_round_trips_and_generation_continues_identically(dtype, coder, tmp_path):
    if coder == "context":
        pytest.importorskip("constriction")
    model = tiny(dtype)
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, cache=DynamicCache(config=model.config), **greedy)
        cache = DynamicCache(config=model.config)
        model(ids[:, :-1], cache=cache)
    path = tmp_path / "prompt.fckv"
    written = save_cache(cache, path, coder=coder)
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


def _two_layer_bytes() -> bytes:
    cache = DynamicCache()
    g = torch.Generator().manual_seed(3)
    for layer in range(2):
        k, v = (torch.randn(1, 2, 70, 16, generator=g).to(torch.bfloat16) for _ in range(2))
        cache.update(k, v, layer)
    return cache_to_bytes(cache)


def _resealed(body: bytes) -> bytes:
    import hashlib

    return body + hashlib.sha256(body).digest()


def test_one_flipped_byte_anywhere_or_a_cut_file_is_refused():
    data = _two_layer_bytes()
    header_end = 6 + 8 + int.from_bytes(data[6:14], "little")
    # a byte in the header, in the first coded tensor (its sign/mantissa bits), in the last, in the digest
    for at in (header_end - 3, header_end + 100, len(data) - 40, len(data) - 1):
        bad = bytearray(data)
        bad[at] ^= 0x01
        with pytest.raises(KVDataError, match="SHA-256"):
            cache_from_bytes(bytes(bad))
    with pytest.raises(KVDataError, match="SHA-256"):
        cache_from_bytes(data[:-50])


def test_a_header_that_does_not_describe_the_bytes_is_refused_even_with_a_matching_digest():
    import json

    data = _two_layer_bytes()[:-32]
    n = int.from_bytes(data[6:14], "little")
    header, blobs = json.loads(data[14 : 14 + n]), data[14 + n :]

    def rebuilt(h) -> bytes:
        text = json.dumps(h).encode()
        return _resealed(data[:6] + len(text).to_bytes(8, "little") + text + blobs)

    dropped = {"layers": header["layers"][:1]}  # one layer entry removed: its bytes are left over
    with pytest.raises(KVDataError, match="describes"):
        cache_from_bytes(rebuilt(dropped))
    for bad, match in (
        ({"layers": {"0": 1}}, "must be a list"),
        ({"layers": [{"empty": False}]}, "sizes"),
        ({"layers": [{"empty": "no", "sizes": []}]}, "boolean 'empty'"),
        ({"layers": [{"empty": False, "sizes": [[[1, 2], "int8", 5], [[1], "bfloat16", 0]]}]}, "size entry"),
    ):
        with pytest.raises(KVDataError, match=match):
            cache_from_bytes(rebuilt(bad))
    wrong_shape = json.loads(json.dumps(header))
    wrong_shape["layers"][0]["sizes"][0][0] = [1, 2, 71, 16]
    with pytest.raises(KVDataError, match="decodes to"):
        cache_from_bytes(rebuilt(wrong_shape))


def test_a_file_of_another_format_says_so():
    with pytest.raises(KVDataError, match="another format"):
        cache_from_bytes(b"FCKV1\n" + bytes(60))
