"""Multi-token steps without a whole-history view: chunked attention over the archive.

:func:`flashcodec.attention.codec_prefill_attention` decodes ``chunk_blocks`` archived blocks at a
time and folds them into an online softmax; it must equal the materialized path (SDPA over the
``read()`` view) within the fp tolerances of ``test_attention.py`` (fp32: 1e-6 of max |out|; half
precision: one output rounding of the fp64 truth) for every tier, batch 1 and 2, GQA, causal
prefill, chunked prefill after earlier tokens, and 4-D masks. The archive never reserves more
than one chunk of spare blocks, so resident bytes stay within held + one chunk + the tail buffer.
"""

from __future__ import annotations

import pytest
import torch
from attention_reference import assert_rejected_unchanged, filled_cache, fp64_truth, refuse_view_reads
from conftest import CODECS
from flashcodec import CodecKVCache
from flashcodec.attention import (
    CHUNK_BLOCKS,
    chunk_blocks_for,
    codec_prefill_attention,
    materialized_prefill_attention,
)
from flashcodec.peak_memory import PeakMemory
from flashcodec.stream import SPARE_BLOCKS
from kvspec import KVConfigError, KVDtypeError, KVShapeError


def filled(tier, *, d=32, **kwargs):
    """:func:`attention_reference.filled_cache` at D = 32 by default."""
    return filled_cache(tier, d=d, **kwargs)


@pytest.fixture
def no_view_reads(monkeypatch):
    refuse_view_reads(monkeypatch, "chunked path")


@pytest.mark.parametrize("batch", [1, 2], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("groups", [1, 4], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("tier", CODECS)
def test_prefill_matches_materialized(tier, groups, batch):
    cache, g = filled(tier, b=batch)
    query = torch.randn(batch, 2 * groups, 203, 32, generator=g)
    got = codec_prefill_attention(query, cache.keys, cache.values, chunk_blocks=3)
    assert not cache.keys.has_view and not cache.values.has_view
    want = materialized_prefill_attention(query, cache.keys, cache.values)
    assert got.shape == want.shape == (batch, 2 * groups, 203, 32)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize("tier", CODECS)
def test_chunked_prefill_after_earlier_tokens(tier):
    # 150 tokens earlier, then a step of 53 (crosses blocks, ends mid-block): queries are the last 53
    cache, g = filled(tier, steps=(150, 53))
    query = torch.randn(2, 4, 53, 32, generator=g)
    for chunk in (1, 5, None):
        got = codec_prefill_attention(query, cache.keys, cache.values, chunk_blocks=chunk)
        want = materialized_prefill_attention(query, cache.keys, cache.values)
        cache.release_view()
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize(
    "dtype, one_rounding, paths", [(torch.bfloat16, 2**-8, 1e-2), (torch.float16, 2**-11, 1.5e-3)]
)
@pytest.mark.parametrize("tier", ["jpeg-k2-int8", "jpeg-k8-int8", "png-keep1"])
def test_half_precision_within_one_rounding_of_the_truth(tier, dtype, one_rounding, paths):
    cache, g = filled(tier, dtype=dtype, seed=3, steps=(120, 83))
    query = torch.randn(2, 4, 83, 32, generator=g).to(dtype)
    got = codec_prefill_attention(query, cache.keys, cache.values, chunk_blocks=4)
    assert got.dtype == dtype
    truth = fp64_truth(query, cache, causal=True, decode_dtype=None)
    scale = truth.abs().max()
    assert (got.double() - truth).abs().max() <= one_rounding * scale
    want = materialized_prefill_attention(query, cache.keys, cache.values)
    assert (got.double() - want.double()).abs().max() <= paths * scale


def test_png_lossless_chunks_are_the_exact_tokens():
    # the decoded chunks are the input bit for bit, so the chunked path equals attention on raw K/V
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(1, 2, 77, 16, generator=g).to(torch.bfloat16)
    values = torch.randn(1, 2, 77, 16, generator=g).to(torch.bfloat16)
    cache = CodecKVCache(codec=CODECS["png-keep1"])
    cache.append(keys, values)
    query = torch.randn(1, 2, 77, 16, generator=g)
    got = codec_prefill_attention(query, cache.keys, cache.values, chunk_blocks=2)
    raw = torch.nn.functional.scaled_dot_product_attention(
        query, keys.float(), values.float(), is_causal=True
    )
    assert (got - raw).abs().max() <= 1e-6 * raw.abs().max()


@pytest.mark.parametrize("tier", ["jpeg-k2-int8", "png-keep1"])
def test_4d_masks_and_fully_masked_queries(tier):
    cache, g = filled(tier, b=2, s=61, steps=(61,))
    query = torch.randn(2, 4, 61, 32, generator=g)
    causal = torch.ones(61, 61, dtype=torch.bool).tril()
    mask = causal.expand(2, 1, 61, 61).clone()
    mask[1, :, :, :9] = False  # left padding of the second row
    got = codec_prefill_attention(query, cache.keys, cache.values, attn_mask=mask, chunk_blocks=2)
    want = materialized_prefill_attention(query, cache.keys, cache.values, attn_mask=mask)
    real = torch.ones(2, 61, dtype=torch.bool)
    real[1, :9] = False  # the padded queries see nothing: zeros here, SDPA's convention may differ
    assert (got - want).abs()[real[:, None, :, None].expand_as(got)].max() <= 1e-6 * want.abs().max()
    assert torch.equal(got[1, :, :9], torch.zeros_like(got[1, :, :9]))
    additive = torch.zeros(2, 1, 61, 61).masked_fill(~mask, float("-inf"))
    again = codec_prefill_attention(query, cache.keys, cache.values, attn_mask=additive, chunk_blocks=2)
    assert torch.equal(again, got)
    plain = codec_prefill_attention(query, cache.keys, cache.values, chunk_blocks=2)
    assert torch.equal(plain[0], got[0])  # the causal default is the same rule for row 0


def test_never_reads_the_view(no_view_reads):
    cache, g = filled("jpeg-k8-int8", steps=(100, 103))
    out = codec_prefill_attention(torch.randn(2, 4, 103, 32, generator=g), cache.keys, cache.values)
    assert torch.isfinite(out).all() and cache.storage_bytes().view == 0


def test_peak_memory_is_one_chunk_not_the_view():
    # 16k tokens of history, a 32-token chunked-prefill step: the K+V view would be 33.5 MB
    cache, g = filled("jpeg-k8-int8", b=1, h=4, s=16384, d=64, seed=1, steps=(16352, 32))
    query = torch.randn(1, 8, 32, 64, generator=g)
    view_bytes = 2 * 4 * 16384 * 64 * 4
    chunk_bytes = 2 * 4 * CHUNK_BLOCKS * 8 * 64 * 4  # one decoded chunk of K and V, fp32
    with PeakMemory() as coded:
        codec_prefill_attention(query, cache.keys, cache.values)
    with PeakMemory() as materialized:
        materialized_prefill_attention(query, cache.keys, cache.values)
    assert coded.peak <= 4 * chunk_bytes and coded.peak < view_bytes / 8, (coded.peak, chunk_bytes)
    assert materialized.peak >= view_bytes


def test_archive_spare_capacity_is_at_most_one_chunk():
    cache = CodecKVCache("jpeg", block_size=2, keep_freqs=1)
    x = torch.randn(1, 1, 2 * 400, 4)
    for start in range(0, x.shape[2], 30):
        cache.append(x[:, :, start : start + 30], x[:, :, start : start + 30])
        stream = cache.keys
        assert stream.capacity - stream.n_blocks <= SPARE_BLOCKS
        st = cache.storage_bytes()
        per_block = sum(b.nbytes for b in stream.archive) // stream.capacity
        tail_buffer = 2 * sum(b.nbytes for b in stream._tail)
        assert st.resident - st.view <= st.held + 2 * SPARE_BLOCKS * per_block + tail_buffer
    assert cache.keys.n_blocks == 400 and cache.keys.capacity <= 400 + SPARE_BLOCKS


BAD = {
    "3d": (lambda q: q[:, :, 0], {}, KVShapeError, "query must be"),
    "too-many": (lambda q: q[:, :, :1].expand(2, 4, 46, 16), {}, KVShapeError, "hold only 45"),
    "heads": (lambda q: q[:, :3], {}, KVShapeError, "multiple of the key/value heads"),
    "int": (lambda q: q.long(), {}, KVDtypeError, "floating point"),
    "not-tensor": (lambda q: q.tolist(), {}, KVDtypeError, "torch.Tensor"),
    "chunk": (lambda q: q, {"chunk_blocks": 0}, KVConfigError, "chunk_blocks"),
    "mask-shape": (
        lambda q: q,
        {"attn_mask": torch.ones(2, 1, 5, 44, dtype=torch.bool)},
        KVShapeError,
        "attn_mask",
    ),
    "mask-dtype": (
        lambda q: q,
        {"attn_mask": torch.ones(2, 1, 5, 45, dtype=torch.long)},
        KVDtypeError,
        "attn_mask",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_calls_raise_and_change_nothing(case):
    make, kwargs, error, match = BAD[case]
    cache, g = filled("jpeg-k2-int8", s=45, d=16, steps=(45,))
    query = torch.randn(2, 4, 5, 16, generator=g)
    assert_rejected_unchanged(
        cache, error, match, lambda: codec_prefill_attention(make(query), cache.keys, cache.values, **kwargs)
    )


def test_the_default_chunk_is_512_tokens_of_blocks():
    # 64 blocks at r = 8; chan64's 64-token blocks go 8 at a time, not 64 (4,096 tokens)
    assert chunk_blocks_for(8) == CHUNK_BLOCKS == 64
    assert chunk_blocks_for(64) == 8 and chunk_blocks_for(1024) == 1
