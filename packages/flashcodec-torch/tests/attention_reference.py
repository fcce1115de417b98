"""What the attention tests (``test_attention.py``, ``test_multitoken.py``) compare against: unit-RMS
random walks, a codec cache filled with them, the fp64 attention over the rows it stores, and a
guard that fails any read of the reconstructed view."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CODECS
from flashcodec import CodecKVCache, CodecStream


def unit_walk(b, h, s, d, *, g, dtype=torch.float32):
    """Random walk along the sequence, every token scaled to RMS 1 (keys of real models are normed)."""
    x = torch.randn(b, h, 1, d, generator=g) + 0.1 * torch.randn(b, h, s, d, generator=g).cumsum(2)
    return (x / x.pow(2).mean(-1, keepdim=True).sqrt()).to(dtype)


def filled_cache(tier, *, b=2, h=2, s=203, d=64, seed=0, dtype=torch.float32, steps=None):
    """``(cache, generator)``: a :class:`CodecKVCache` of ``CODECS[tier]`` holding ``s`` tokens of
    :func:`unit_walk` keys and values, appended in ``steps`` (their sum is ``s``; default one append),
    and the generator they were drawn from, for the query."""
    g = torch.Generator().manual_seed(seed)
    cache = CodecKVCache(codec=CODECS[tier])
    keys, values = unit_walk(b, h, s, d, g=g, dtype=dtype), unit_walk(b, h, s, d, g=g, dtype=dtype)
    start = 0
    for n in steps or (s,):
        cache.append(keys[:, :, start : start + n], values[:, :, start : start + n])
        start += n
    assert start == s
    return cache, g


def fp64_truth(query, cache, *, causal=False, decode_dtype=torch.float64):
    """Attention in fp64 over the stored rows: archived blocks decoded to ``decode_dtype`` (None: the
    stream's dtype, as the chunked path sees them), the tail as held; ``causal``: the queries are the
    last ``query.shape[2]`` positions, each attending to itself and what came before."""
    groups = query.shape[1] // cache.keys.heads

    def full(stream):
        archived = cache.codec.decode(stream.archived_parts(), decode_dtype or stream.dtype).double()
        return torch.cat([archived, stream.tail().double()], 2).repeat_interleave(groups, dim=1)

    k, v = full(cache.keys), full(cache.values)
    scores = query.double() @ k.transpose(-1, -2) / math.sqrt(query.shape[-1])
    if causal:
        s, total = query.shape[2], k.shape[2]
        pos_q = torch.arange(total - s, total)
        scores = scores.masked_fill(torch.arange(total)[None, :] > pos_q[:, None], -math.inf)
    return scores.softmax(-1) @ v


def refuse_view_reads(monkeypatch, path: str, decoding_tiers=()) -> None:
    """Make any read of the reconstructed view fail loudly, naming ``path``; and any decode of an
    archived block by the codec classes of ``decoding_tiers``."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"the {path} read the reconstructed view")

    monkeypatch.setattr(CodecStream, "read", refuse)
    monkeypatch.setattr(CodecStream, "_ensure_view", refuse)
    for name in decoding_tiers:
        monkeypatch.setattr(type(CodecKVCache(codec=CODECS[name]).codec), "decode", refuse)


def assert_rejected_unchanged(cache, error, match, call) -> None:
    """``call()`` raises ``error`` matching ``match`` and leaves ``cache`` as it was: every state
    tensor equal, no view built."""
    before = [t.clone() for t in cache.state]
    with pytest.raises(error, match=match):
        call()
    assert all(torch.equal(a, b) for a, b in zip(before, cache.state, strict=True))
    assert not cache.keys.has_view
