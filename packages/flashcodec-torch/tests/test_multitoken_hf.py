"""Materialization-free path in transformers for multi-token steps: resident bytes and exactness.

With :func:`flashcodec.hf.apply_codec_attention`, a prefill, a chunked prefill and decode steps
all run without a whole-history view, so after each of them every codec layer's resident bytes
(measured from the tensors it holds) stay within held + one chunk of spare archive blocks + the
raw tail buffers, for every tier and batch 1 and 2. On the embedded model, png keep=1.0 through
these paths (chunked prefill, greedy, beam search) gives exactly the unpatched model's tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from conftest import CODECS, TOKEN_IDS, tiny_model  # noqa: E402
from flashcodec.hf import (  # noqa: E402
    FlashCodecCache,
    apply_codec_attention,
    apply_flash_codec,
    remove_codec_attention,
    remove_flash_codec,
)
from flashcodec.stream import SPARE_BLOCKS  # noqa: E402

PROMPT = (
    "The os module provides a portable way of using operating system dependent functionality. "
    "If you just want to read or write a file see open(), if you want to manipulate paths, "
    "see the os.path module, and if you want to read all the lines in all the files on the "
    "command line see the fileinput module."
)


def tiny(seed=0):
    return tiny_model(seed=seed, max_positions=2048, **TOKEN_IDS)


def resident_bound(layer) -> int:
    """held + one chunk of spare archive blocks (stored form) + the raw tail buffers, K and V."""
    cc = layer.codec_cache
    bound = 0
    for stream in (cc.keys, cc.values):
        itemsize = torch.empty((), dtype=stream.dtype).element_size()
        per_block = 0
        for spec in cc.codec.part_specs(stream.dim):
            part_item = torch.empty((), dtype=spec.dtype or stream.dtype).element_size()
            per_block += math.prod(spec.shape) * part_item
        bound += (
            stream.batch
            * stream.heads
            * (SPARE_BLOCKS * per_block + cc.codec.block_size * stream.dim * itemsize)
        )
    return layer.storage_bytes().held + bound


def check_resident(cache: FlashCodecCache) -> None:
    for i in cache.codec_layer_indices:
        layer = cache.layers[i]
        st = layer.storage_bytes()
        assert st.view == 0 and layer.keys.shape[2] == 0 and layer.values.shape[2] == 0
        assert st.resident <= resident_bound(layer), (i, st)


@pytest.mark.parametrize("batch", [1, 2], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("tier", CODECS)
def test_resident_within_held_plus_one_chunk_and_tail(tier, batch):
    model = tiny()
    ids = torch.randint(3, 128, (batch, 1200), generator=torch.Generator().manual_seed(1))
    cache = FlashCodecCache.from_config(model.config, codec=CODECS[tier])
    stats = apply_codec_attention(model, backend="torch")
    try:
        with torch.no_grad():
            model(ids[:, :1100], cache=cache, logits_to_keep=1)  # prefill: 137 blocks, capacity capped
            check_resident(cache)
            for start in (1100, 1150):  # chunked prefill
                model(ids[:, start : start + 50], cache=cache, logits_to_keep=1)
                check_resident(cache)
            token = ids[:, -1:]
            for _ in range(9):
                token = model(token, cache=cache).logits[:, -1:].argmax(-1)
                check_resident(cache)
    finally:
        remove_codec_attention(model)
    assert stats.chunked == 3 * 2 and stats.coded == 9 * 2 and stats.fallbacks == {}
    stream = cache.layers[0].codec_cache.keys
    assert stream.capacity - stream.n_blocks <= SPARE_BLOCKS < stream.capacity // 2  # the cap did act
    from flashcodec.compare import cache_bytes

    reported = cache_bytes(cache)  # what `flashcodec compare` reports
    assert reported.resident == cache.storage_bytes().resident + cache.native_nbytes()
    assert reported.resident <= sum(resident_bound(cache.layers[i]) for i in cache.codec_layer_indices)


def test_chunked_prefill_equals_one_prefill_on_the_lossless_tier():
    # (on a lossy tier the two differ by design: a step's queries see their own block's tokens raw
    # while it is incomplete, and reconstructed once a step archives it)
    model = tiny()
    ids = torch.randint(3, 128, (2, 90), generator=torch.Generator().manual_seed(2))
    apply_codec_attention(model, backend="torch")
    try:
        with torch.no_grad():
            whole = FlashCodecCache.from_config(model.config, codec=CODECS["png-keep1"])
            want = model(ids, cache=whole).logits[:, -30:]
            parts = FlashCodecCache.from_config(model.config, codec=CODECS["png-keep1"])
            model(ids[:, :37], cache=parts)
            model(ids[:, 37:60], cache=parts)
            got = model(ids[:, 60:], cache=parts).logits
    finally:
        remove_codec_attention(model)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.fixture(scope="module")
def embedded(embedded_model):
    model, tokenizer = embedded_model
    return model, tokenizer(PROMPT, return_tensors="pt").input_ids


def test_embedded_png_beam_search_equals_the_unpatched_model(embedded):
    model, ids = embedded
    kw = dict(num_beams=4, num_return_sequences=2, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    base = model.generate(ids, **kw)
    apply_flash_codec(model, mode="png", keep_ratio=1.0, materialization_free=True)
    try:
        out = model.generate(ids, return_dict_in_generate=True, **kw)
    finally:
        remove_flash_codec(model)
    assert torch.equal(out.sequences, base)
    check_resident(out.cache)


def test_embedded_png_chunked_prefill_then_greedy_equals_the_unpatched_model(embedded):
    model, ids = embedded
    new = 24
    base = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    cache = FlashCodecCache.from_config(model.config, mode="png", keep_ratio=1.0)
    stats = apply_codec_attention(model, backend="torch")
    try:
        with torch.no_grad():
            cuts = [0, 13, 30, ids.shape[1]]
            for a, b in zip(cuts, cuts[1:], strict=False):
                logits = model(ids[:, a:b], cache=cache).logits
            tokens = [logits[:, -1:].argmax(-1)]
            for _ in range(new - 1):
                tokens.append(model(tokens[-1], cache=cache).logits[:, -1:].argmax(-1))
    finally:
        remove_codec_attention(model)
    layers = model.config.num_hidden_layers
    assert stats.chunked == 3 * layers and stats.coded == (new - 1) * layers
    assert torch.equal(torch.cat([ids, *tokens], dim=1), base)
    check_resident(cache)


def test_a_cache_without_config_gets_its_layers_on_the_coded_path():
    model = tiny()
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    run = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    base = model.generate(ids, **run)
    stats = apply_codec_attention(model, backend="torch")
    try:
        cache = FlashCodecCache(mode="png")  # no config: codec layers are created as they are reached
        out = model.generate(ids, cache=cache, **run)
    finally:
        remove_codec_attention(model)
    assert stats.chunked == 2 and stats.coded == 11 * 2 and stats.fallbacks == {}
    assert cache.codec_layer_indices == [0, 1] and torch.equal(out, base)
    check_resident(cache)


def test_a_rejected_step_leaves_the_layer_as_it_was():
    from kvspec import KVValueError

    model = tiny()
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(4))
    cache = FlashCodecCache.from_config(model.config, mode="png")
    attn = model.model.layers[0].self_attn
    apply_codec_attention(model, backend="torch")
    try:
        with torch.no_grad():
            hidden = torch.full((1, 5, 64), float("nan"))
            cos, sin = model.model.rotary_emb(hidden, torch.arange(5)[None])
            with pytest.raises(KVValueError, match="NaN"):
                attn(hidden_states=hidden, position_embeddings=(cos, sin), attention_mask=None, cache=cache)
            layer = cache.layers[0]
            assert not layer.is_initialized and layer.get_seq_length() == 0
            model(ids, cache=cache)  # the cache still works
    finally:
        remove_codec_attention(model)
    assert cache.get_seq_length() == 20
