"""Coefficient-domain decode attention (torch backend): equal to the materialized path, never
builds the view, GQA and padding masks, split invariance, validation.

Tolerances (measured on unit-RMS random walks, D=64, S=203, 10 seeds; see the docs):
fp32: max |coef - materialized| <= 1e-6 x max |out| (worst seen 9.6e-7 over 10 seeds x 12 configs;
the cases here are seeded). bf16 / fp16: both paths
round their output, so each is compared with the fp64 truth instead: within one output rounding
(2^-8 resp. 2^-11 of max |out|; worst seen 3.0e-3 / 3.9e-4), and the two paths within 1e-2 / 1.5e-3.
"""

from __future__ import annotations

import pytest
import torch
from attention_reference import assert_rejected_unchanged, filled_cache, fp64_truth, refuse_view_reads
from flashcodec import CodecStream
from flashcodec.attention import (
    TORCH_CHUNK_BYTES,
    codec_decode_attention,
    coded_rows,
    materialized_decode_attention,
)
from flashcodec.kernels.naive import combine_partials, decode_attention_partials, dense_rows
from flashcodec.peak_memory import PeakMemory
from kvspec import KVConfigError, KVDtypeError, KVShapeError

ATTN_TIERS = [
    "jpeg-k2",
    "jpeg-k2-int8",
    "jpeg-k4",
    "jpeg-k8-int8",
    "jpeg-k8-int4",
    "jpeg-k8-int4z",
    "png-keep1",
    "png-keep0.5",
]


@pytest.fixture
def no_view_reads(monkeypatch):
    """Make any read of the reconstructed view (or any decode of an archived block) fail loudly."""
    refuse_view_reads(monkeypatch, "coefficient-domain path", decoding_tiers=("jpeg-k2", "png-keep1"))


@pytest.mark.parametrize("groups", [1, 4], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("tier", ATTN_TIERS)
def test_fp32_matches_materialized(tier, groups):
    cache, g = filled_cache(tier, h=2)
    query = torch.randn(2, 2 * groups, 1, 64, generator=g)
    got = codec_decode_attention(query, cache.keys, cache.values)
    assert not cache.keys.has_view and not cache.values.has_view
    want = materialized_decode_attention(query, cache.keys, cache.values)
    assert got.shape == (2, 2 * groups, 1, 64) and got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize(
    "dtype, one_rounding, paths", [(torch.bfloat16, 2**-8, 1e-2), (torch.float16, 2**-11, 1.5e-3)]
)
@pytest.mark.parametrize("tier", ["jpeg-k2-int8", "jpeg-k4", "png-keep1"])
def test_half_precision_within_one_rounding_of_the_truth(tier, dtype, one_rounding, paths):
    cache, g = filled_cache(tier, dtype=dtype, seed=3)
    query = torch.randn(2, 6, 1, 64, generator=g).to(dtype)
    got = codec_decode_attention(query, cache.keys, cache.values)
    assert got.dtype == dtype
    truth = fp64_truth(query, cache)
    scale = truth.abs().max()
    assert (got.double() - truth).abs().max() <= one_rounding * scale
    want = materialized_decode_attention(query, cache.keys, cache.values)
    assert (got.double() - want.double()).abs().max() <= paths * scale


@pytest.mark.parametrize("tier", ["jpeg-k2-int8", "png-keep1"])
def test_never_reads_the_view(tier, no_view_reads):
    cache, g = filled_cache(tier)
    query = torch.randn(2, 4, 1, 64, generator=g)
    out = codec_decode_attention(query, cache.keys, cache.values, backend="torch")
    assert torch.isfinite(out).all()
    assert not cache.keys.has_view and not cache.values.has_view
    assert cache.storage_bytes().view == 0
    with pytest.raises(AssertionError, match="read the reconstructed view"):  # the guard itself works
        materialized_decode_attention(query, cache.keys, cache.values)


def test_peak_memory_stays_far_below_the_view():
    # 16k tokens, 4 kv heads, D=64, fp32: the K+V view is 33.5 MB; the coded path allocates chunk
    # temporaries only (no tensor above TORCH_CHUNK_BYTES = 2 MiB), the materialized path the view.
    cache, g = filled_cache("jpeg-k2-int8", b=1, h=4, s=16384, seed=1)
    query = torch.randn(1, 8, 1, 64, generator=g)
    view_bytes = 2 * 1 * 4 * 16384 * 64 * 4
    with PeakMemory() as coded:
        codec_decode_attention(query, cache.keys, cache.values)
    with PeakMemory() as materialized:
        materialized_decode_attention(query, cache.keys, cache.values)
    assert coded.peak < view_bytes / 8
    assert coded.largest <= TORCH_CHUNK_BYTES
    assert materialized.peak >= view_bytes  # the tracker does see a view being built


@pytest.mark.parametrize("tier", ["jpeg-k2-int8", "png-keep1"])
def test_batch_with_padding_mask(tier):
    cache, g = filled_cache(tier, b=3, s=61)
    query = torch.randn(3, 4, 1, 64, generator=g)
    mask = torch.ones(3, 61, dtype=torch.bool)
    mask[1, :9] = False  # left padding of different lengths
    mask[2, :30] = False
    got = codec_decode_attention(query, cache.keys, cache.values, key_mask=mask)
    want = materialized_decode_attention(query, cache.keys, cache.values, key_mask=mask)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    additive = torch.zeros(3, 61).masked_fill(~mask, float("-inf"))
    assert torch.equal(codec_decode_attention(query, cache.keys, cache.values, key_mask=additive), got)
    unmasked = codec_decode_attention(query, cache.keys, cache.values)
    assert torch.equal(unmasked[0], got[0])  # row 0 has no padding
    assert (unmasked[1:] - got[1:]).abs().max() > 1e-2  # the mask is applied, not ignored


@pytest.mark.parametrize("seq", [3, 8, 40, 45], ids=lambda s: f"S{s}")
def test_splits_and_tail_lengths_agree(seq):
    # S=3: tail only; S=8 and 40: no tail; S=45: 5 blocks + 5 tail tokens
    cache, g = filled_cache("jpeg-k2-int8", s=seq, d=16)
    query = torch.randn(2, 4, 1, 16, generator=g)
    outs = [
        codec_decode_attention(query, cache.keys, cache.values, blocks_per_split=n) for n in (None, 1, 2, 3)
    ]
    want = materialized_decode_attention(query, cache.keys, cache.values)
    for out in outs:
        assert (out - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize("tier", ATTN_TIERS)
def test_coded_rows_address_the_codec_rows(tier):
    # segments + scales as the kernels read them are exactly the codec's rows (A @ rows = block)
    cache, _ = filled_cache(tier, s=45, d=16)
    for stream in (cache.keys, cache.values):
        rows = coded_rows(stream)
        assert all(
            seg.untyped_storage().data_ptr() == stream.archive[0].untyped_storage().data_ptr()
            for seg in rows.segments[:1]
        )  # views of the archive, no copy
        assert torch.equal(dense_rows(rows, 0, rows.n_blocks), stream.stored_rows(torch.float32))
        assert rows.seq_len == stream.seq_len and torch.equal(rows.tail, stream.tail())


def test_partials_combine_to_the_softmax():
    cache, g = filled_cache("jpeg-k2", s=45, d=16)
    query = torch.randn(2, 2, 16, generator=g)
    keys, values = coded_rows(cache.keys), coded_rows(cache.values)
    m, denom, acc = decode_attention_partials(query, keys, values, scale=0.25, blocks_per_split=2)
    assert m.shape == (2, 2, 4) and acc.shape == (2, 2, 4, 16)  # 3 block splits + the tail
    # each split alone is a softmax over its own tokens: acc / denom is a convex mix of its values
    k, v = cache.read()
    scores = 0.25 * torch.einsum("bhd,bhsd->bhs", query, k)
    assert torch.allclose(m[..., 0], scores[..., :16].amax(-1), atol=1e-5)
    assert torch.allclose(denom[..., 3], torch.exp(scores[..., 40:] - m[..., 3:4]).sum(-1), atol=1e-5)
    want = torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), v)
    assert torch.allclose(combine_partials(m, denom, acc), want, atol=1e-6)


def test_streams_are_only_read():
    cache, g = filled_cache("jpeg-k2-int8", s=45, d=16)
    before = [t.clone() for t in cache.state]
    codec_decode_attention(torch.randn(2, 2, 1, 16, generator=g), cache.keys, cache.values)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.state, strict=True))
    assert cache.offset == 45 and not cache.keys.has_view


BAD_CALLS = {
    "query-3d": (lambda q: q[:, :, 0], {}, KVShapeError, "query must be"),
    "two-tokens": (lambda q: q.expand(2, 4, 2, 16), {}, KVShapeError, "one new token"),
    "batch": (lambda q: q[:1], {}, KVShapeError, "B=2"),
    "head-dim": (lambda q: q[..., :8], {}, KVShapeError, "D=16"),
    "heads": (lambda q: q[:, :3], {}, KVShapeError, "multiple of the key/value heads"),
    "int-query": (lambda q: q.long(), {}, KVDtypeError, "floating point"),
    "not-a-tensor": (lambda q: q.tolist(), {}, KVDtypeError, "torch.Tensor"),
    "backend": (lambda q: q, {"backend": "cuda"}, KVConfigError, "backend"),
    "split": (lambda q: q, {"blocks_per_split": 0}, KVConfigError, "blocks_per_split"),
    "scale": (lambda q: q, {"scale": -1.0}, KVConfigError, "scale"),
    "mask-shape": (lambda q: q, {"key_mask": torch.ones(2, 44, dtype=torch.bool)}, KVShapeError, "key_mask"),
    "mask-dtype": (lambda q: q, {"key_mask": torch.ones(2, 45, dtype=torch.long)}, KVDtypeError, "key_mask"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_raise_and_change_nothing(case):
    make, kwargs, error, match = BAD_CALLS[case]
    cache, g = filled_cache("jpeg-k2-int8", s=45, d=16)
    query = torch.randn(2, 4, 1, 16, generator=g)
    assert_rejected_unchanged(
        cache, error, match, lambda: codec_decode_attention(make(query), cache.keys, cache.values, **kwargs)
    )


def test_mismatched_or_empty_streams_raise():
    cache, g = filled_cache("jpeg-k2", s=45, d=16)
    other, _ = filled_cache("jpeg-k2", s=44, d=16)
    query = torch.randn(2, 4, 1, 16, generator=g)
    with pytest.raises(KVShapeError, match="must agree"):
        codec_decode_attention(query, cache.keys, other.values)
    empty = CodecStream(cache.codec, 2, 2, 16, torch.float32, "cpu")
    with pytest.raises(KVShapeError, match="no token"):
        codec_decode_attention(query, empty, empty)
    with pytest.raises(KVDtypeError, match="CodecStream"):
        codec_decode_attention(query, cache, cache.values)
