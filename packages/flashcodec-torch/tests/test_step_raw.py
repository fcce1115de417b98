"""A multi-token step attends its own tokens as given and the earlier tokens as stored (``step_raw``).

The tokens are stored coded either way; only what the step's own queries see changes. Evidence:
the layer's ``update`` returns the step's inputs themselves (a single prefill of a lossy tier
gives exactly the uncompressed model's logits), codec attention with the step's raw keys equals an
fp64 reference over [stored prefix, raw step] wherever the step starts (inside an archived block,
inside the tail, at a block edge), and ``step_raw=False`` keeps the old behaviour.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from flashcodec import CodecKVCache, JPEGCodec, PNGCodec  # noqa: E402
from flashcodec.attention import codec_prefill_attention  # noqa: E402
from flashcodec.codecs import ChannelInt4Codec  # noqa: E402
from flashcodec.hf import FlashCodecCache, FlashCodecLayer, apply_codec_attention, remove_codec_attention  # noqa: E402
from kvspec import KVConfigError, KVDtypeError, KVShapeError  # noqa: E402
from transformers import DynamicCache  # noqa: E402

LOSSY = {
    "chan8-int4-w8i8": ChannelInt4Codec(8, raw_window=8, window_bits=8),
    "jpeg-k2-int8": JPEGCodec(8, keep_freqs=2, quant_bits=8),
}


from conftest import tiny_qwen3  # noqa: E402


def kv(b=2, h=2, s=21, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, s, d, generator=g).to(dtype), torch.randn(b, h, s, d, generator=g).to(dtype)


def tiny(seed=0, dtype=torch.float32):
    return tiny_qwen3(seed, dtype)


# ---------------------------------------------------------------- the layer (materialized path)
@pytest.mark.parametrize("name", LOSSY)
def test_update_returns_the_step_raw_and_the_prefix_stored(name):
    layer = FlashCodecLayer(codec=LOSSY[name])
    k, v = kv(s=40)
    out_k, out_v = layer.update(k[:, :, :21], v[:, :, :21])
    assert out_k is k[:, :, :21] or torch.equal(out_k, k[:, :, :21])  # the first call: the inputs
    assert not torch.equal(layer.keys, k[:, :, :21])  # a lossy tier: the stored form differs
    out_k, out_v = layer.update(k[:, :, 21:37], v[:, :, 21:37])  # a chunk after earlier tokens
    stored_k, stored_v = layer.codec_cache.read()
    assert torch.equal(out_k[:, :, :21], stored_k[:, :, :21])
    assert torch.equal(out_v[:, :, :21], stored_v[:, :, :21])
    assert torch.equal(out_k[:, :, 21:], k[:, :, 21:37]) and torch.equal(out_v[:, :, 21:], v[:, :, 21:37])
    assert torch.equal(layer.keys, layer.codec_cache.read()[0])  # the memoized view keeps the codes
    out_k, _ = layer.update(k[:, :, 37:38], v[:, :, 37:38])  # a decode step: the stored form
    assert out_k is layer.keys


@pytest.mark.parametrize("name", LOSSY)
def test_step_raw_false_returns_the_stored_form(name):
    layer = FlashCodecLayer(codec=LOSSY[name], step_raw=False)
    k, v = kv(s=21)
    out_k, _ = layer.update(k, v)
    assert out_k is layer.keys and not torch.equal(out_k, k)


def test_bad_step_raw_is_rejected():
    for bad in (1, "yes", None):
        with pytest.raises(KVConfigError, match="step_raw"):
            FlashCodecLayer(mode="png", step_raw=bad)
        with pytest.raises(KVConfigError, match="step_raw"):
            FlashCodecCache(mode="png", step_raw=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", LOSSY)
def test_a_single_prefill_equals_the_uncompressed_model_exactly(name, dtype):
    model = tiny(dtype=dtype)
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids, cache=DynamicCache(config=model.config)).logits
        got = model(ids, cache=FlashCodecCache.from_config(model.config, codec=LOSSY[name])).logits
        coded = model(
            ids, cache=FlashCodecCache.from_config(model.config, codec=LOSSY[name], step_raw=False)
        ).logits
    assert torch.equal(got, want)
    assert not torch.equal(coded, want)


# ---------------------------------------------------------------- codec attention (no view)
def _reference(query, cache, step_k, step_v):
    """fp64 causal attention of the last ``s`` tokens over [stored prefix, raw step]."""
    s, total = query.shape[2], cache.offset
    groups = query.shape[1] // cache.keys.heads
    sk, sv = cache.read()
    k = torch.cat([sk[:, :, : total - s], step_k], 2).double().repeat_interleave(groups, 1)
    v = torch.cat([sv[:, :, : total - s], step_v], 2).double().repeat_interleave(groups, 1)
    scores = query.double() @ k.transpose(-1, -2) / math.sqrt(query.shape[-1])
    pos_q = torch.arange(total - s, total)
    scores = scores.masked_fill(torch.arange(total)[None, :] > pos_q[:, None], -math.inf)
    return scores.softmax(-1) @ v


@pytest.mark.parametrize(
    "first,step",
    [(0, 29), (21, 16), (24, 5), (19, 2), (35, 1)],
    ids=["prefill", "into-a-block", "at-a-block-edge", "inside-the-tail", "one-token"],
)
@pytest.mark.parametrize("name", LOSSY)
def test_codec_prefill_with_the_step_raw_equals_the_reference(name, first, step):
    k, v = kv(s=first + step, seed=3)
    cache = CodecKVCache(codec=LOSSY[name])
    if first:
        cache.append(k[:, :, :first], v[:, :, :first])
    cache.append(k[:, :, first:], v[:, :, first:])
    query = torch.randn(2, 4, step, 16, generator=torch.Generator().manual_seed(4))
    got = codec_prefill_attention(
        query,
        cache.keys,
        cache.values,
        step_keys=k[:, :, first:],
        step_values=v[:, :, first:],
        chunk_blocks=1,
    )
    want = _reference(query, cache, k[:, :, first:], v[:, :, first:])
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # without the step's keys: the stored form of every token, the step's own included
    coded = codec_prefill_attention(query, cache.keys, cache.values, chunk_blocks=1)
    sk, sv = cache.read()
    stored = _reference(query, cache, sk[:, :, first:], sv[:, :, first:])
    assert (coded.double() - stored).abs().max() <= 1e-5 * stored.abs().max()


def test_codec_prefill_step_arguments_are_checked():
    k, v = kv(s=12)
    cache = CodecKVCache(codec=PNGCodec(8))
    cache.append(k, v)
    q = torch.randn(2, 2, 4, 16)
    step_k, step_v = k[:, :, 8:], v[:, :, 8:]
    with pytest.raises(KVConfigError, match="together"):
        codec_prefill_attention(q, cache.keys, cache.values, step_keys=step_k)
    with pytest.raises(KVShapeError, match="step_keys"):
        codec_prefill_attention(q, cache.keys, cache.values, step_keys=k[:, :, 7:], step_values=step_v)
    with pytest.raises(KVDtypeError, match="step_values"):
        codec_prefill_attention(q, cache.keys, cache.values, step_keys=step_k, step_values=step_v.double())
    with pytest.raises(KVDtypeError, match="step_keys"):
        codec_prefill_attention(q, cache.keys, cache.values, step_keys=[1], step_values=step_v)


@pytest.mark.parametrize("step_raw", [True, False])
def test_codec_attention_follows_the_cache_setting(step_raw):
    """The codec-attention wrapper passes the step's raw keys exactly when the cache says so: its
    logits match the materialized path of the same setting, for a prefill and a later chunk."""
    model = tiny()
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(5))
    codec = LOSSY["chan8-int4-w8i8"]

    def run(mf):
        cache = FlashCodecCache.from_config(model.config, codec=codec, step_raw=step_raw)
        stats = apply_codec_attention(model, backend="torch") if mf else None
        try:
            with torch.no_grad():
                first = model(ids[:, :50], cache=cache).logits
                second = model(ids[:, 50:], cache=cache).logits
        finally:
            if mf:
                remove_codec_attention(model)
        if mf:
            assert stats.chunked == 4 and not stats.fallbacks
        return torch.cat([first, second], 1)

    got, want = run(True), run(False)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    if step_raw:
        with torch.no_grad():
            plain = model(ids[:, :50], cache=DynamicCache(config=model.config)).logits
        assert (got[:, :50] - plain).abs().max() <= 1e-4 * plain.abs().max()


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
def test_the_raw_step_in_chunks_equals_one_chunk(masked):
    """A long raw step is attended in causal chunks; cut every 5 tokens, the result equals the
    kernel's single tail chunk (and an explicit 4-D mask is honoured chunk by chunk)."""
    from flashcodec.attention import _prefill_split_tail, coded_rows, step_rows
    from flashcodec.kernels.naive import prefill_attention_naive

    k, v = kv(s=61, seed=6)
    cache = CodecKVCache(codec=LOSSY["chan8-int4-w8i8"])
    cache.append(k[:, :, :19], v[:, :, :19])
    cache.append(k[:, :, 19:], v[:, :, 19:])
    query = torch.randn(2, 4, 42, 16, generator=torch.Generator().manual_seed(7))
    keys = step_rows(coded_rows(cache.keys), k[:, :, 19:])
    values = step_rows(coded_rows(cache.values), v[:, :, 19:])
    mask = None
    if masked:
        mask = torch.zeros(2, 1, 42, 61)
        mask[0, :, :, 3:9] = -math.inf  # a hidden span in the coded prefix
        mask[1, :, :, 40:] = -math.inf  # and one in the raw step
    args = dict(scale=0.25, mask=mask, chunk_blocks=1)
    got = _prefill_split_tail(query, keys, values, tail_tokens=5, **args)
    want = prefill_attention_naive(query, keys, values, **args)
    assert keys.tail.shape[2] == 42 + 3  # three decoded tokens of the block the step starts in
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
