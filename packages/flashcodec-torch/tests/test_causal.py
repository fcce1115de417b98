"""Causal safety of CodecKVCache: no future leakage, archived rows never rewritten, incremental
equals full, memoized read equals a full decode, exact crop, beam-search gather."""

from __future__ import annotations

import pytest
import torch
from conftest import CODECS, random_walk
from flashcodec import CodecKVCache
from flashcodec.stream import SPARE_BLOCKS

LOSSY = [t for t in CODECS if t != "png-keep1"]


def feed_steps(cache, k, v):
    """Append one token at a time; return the (cloned) outputs of every step."""
    outs = []
    for t in range(k.shape[2]):
        ok, ov = cache.decode_step(k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append((ok.clone(), ov.clone()))
    return outs


def attention(q, k, v):
    """Plain softmax attention of queries ``q [B, H, 1, D]`` over ``k, v [B, H, S, D]`` (fp64)."""
    scores = q.double() @ k.double().transpose(-1, -2) / k.shape[-1] ** 0.5
    return scores.softmax(-1) @ v.double()


@pytest.mark.parametrize("tier", CODECS)
def test_zero_future_leakage(tier):
    # two streams share their first 29 tokens and then diverge: every output up to step 29 is
    # bitwise identical, however different the future is
    k = random_walk(s=60, seed=1)
    v = random_walk(s=60, seed=2)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 29:] = 100 * random_walk(s=31, seed=7)
    v2[:, :, 29:] = -v2[:, :, 29:]
    a = feed_steps(CodecKVCache(codec=CODECS[tier]), k, v)
    b = feed_steps(CodecKVCache(codec=CODECS[tier]), k2, v2)
    for t in range(29):
        assert torch.equal(a[t][0], b[t][0]) and torch.equal(a[t][1], b[t][1]), t
    # and the later outputs still agree on the shared prefix's archived blocks (24 = 3 blocks)
    assert torch.equal(a[-1][0][:, :, :24], b[-1][0][:, :, :24])


@pytest.mark.parametrize("tier", CODECS)
def test_archived_rows_are_never_rewritten(tier):
    cache = CodecKVCache(codec=CODECS[tier])
    k, v = random_walk(s=300, seed=3), random_walk(s=300, seed=4)
    snapshots = []
    for t in range(k.shape[2]):
        cache.decode_step(k[:, :, t : t + 1], v[:, :, t : t + 1])
        if t % 17 == 0:
            snapshots.append(
                [p.clone() for p in (*cache.keys.archived_parts(), *cache.values.archived_parts())]
            )
    final = [*cache.keys.archived_parts(), *cache.values.archived_parts()]
    # 37 blocks (fewer behind a raw window), the archive reallocated on the way every SPARE_BLOCKS
    assert cache.keys.n_blocks == (300 - cache.codec.raw_window) // cache.codec.block_size
    assert 0 <= cache.keys.capacity - cache.keys.n_blocks <= SPARE_BLOCKS
    for snap in snapshots:
        for old, now in zip(snap, final, strict=True):
            n = old.shape[2]
            assert torch.equal(old, now[:, :, :n])


@pytest.mark.parametrize("tier", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_incremental_equals_full_fill(tier, dtype):
    # blocks start at token 0 either way, so the archive and the final view agree
    k, v = random_walk(s=77, seed=5, dtype=dtype), random_walk(s=77, seed=6, dtype=dtype)
    full_k, full_v = CodecKVCache(codec=CODECS[tier]).forward(k, v)
    step = CodecKVCache(codec=CODECS[tier])
    step.forward(k[:, :, :10], v[:, :, :10])
    for chunk in (1, 5, 1, 13, 1, 1, 20, 8, 3, 1, 14):  # mixed multi-token appends
        start = step.offset
        sk, sv = step.update_and_fetch(k[:, :, start : start + chunk], v[:, :, start : start + chunk])
    assert step.offset == 77
    codec = CODECS[tier]
    if codec.window_bits is None or (77 - codec.raw_window) // codec.block_size == 0:
        assert torch.equal(sk, full_k) and torch.equal(sv, full_v)
    else:
        # an int8 tail keeps no originals: a block completed by later appends is coded from its
        # tokens' int8 codes: at 2-3 bits that moves the codes at level boundaries by a step, so the
        # two fills differ by less than the code's own error, not bit for bit
        for got, full, x in ((sk, full_k, k), (sv, full_v, v)):
            assert (got.float() - full.float()).norm() <= (full.float() - x.float()).norm()


def test_lossless_step_attention_matches_full_sequence_attention():
    b, h, s, d = 2, 4, 70, 16
    k, v, q = (
        random_walk(b, h, s, d, seed=1),
        random_walk(b, h, s, d, seed=2),
        random_walk(b, h, s, d, seed=3),
    )
    cache = CodecKVCache(codec=CODECS["png-keep1"])
    worst = 0.0
    for t in range(s):
        ck, cv = cache.decode_step(k[:, :, t : t + 1], v[:, :, t : t + 1])
        step = attention(q[:, :, t : t + 1], ck, cv)
        full = attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1])
        worst = max(worst, float((step - full).abs().max()))
    assert worst <= 1e-4
    assert worst == 0.0  # bitwise lossless K/V give identical attention


@pytest.mark.parametrize("tier", CODECS)
def test_memoized_read_equals_full_decode(tier):
    cache = CodecKVCache(codec=CODECS[tier])
    k = random_walk(s=150, seed=8)
    for t in range(k.shape[2]):
        ok, _ = cache.decode_step(k[:, :, t : t + 1], k[:, :, t : t + 1])
    stream = cache.keys
    decoded = stream.codec.decode(stream.archived_parts(), k.dtype)  # every block at once
    expect = torch.cat([decoded, stream.tail()], dim=2)
    assert torch.equal(ok, expect)
    assert stream.view_blocks == stream.n_blocks  # decoded once each, incrementally


def test_read_decodes_only_new_blocks(monkeypatch):
    cache = CodecKVCache(codec=CODECS["jpeg-k2"])
    k = random_walk(s=200, seed=9)
    cache.forward(k[:, :, :160], k[:, :, :160])
    decoded_blocks = []
    codec = cache.codec
    original = type(codec).decode

    def counting_decode(self, parts, dtype):
        decoded_blocks.append(parts[0].shape[2])
        return original(self, parts, dtype)

    monkeypatch.setattr(type(codec), "decode", counting_decode)
    for t in range(160, 200):
        cache.decode_step(k[:, :, t : t + 1], k[:, :, t : t + 1])
    # 40 steps complete 5 blocks per stream: 10 decodes of one block each, no history re-decode
    assert decoded_blocks == [1] * 10


@pytest.mark.parametrize("tier", CODECS)
@pytest.mark.parametrize("cut", [21, 24, 43, 3])
def test_crop_is_exact_and_repeatable(tier, cut):
    k, v = random_walk(s=45, seed=10), random_walk(s=45, seed=11)
    cache = CodecKVCache(codec=CODECS[tier])
    before_k, before_v = (t.clone() for t in cache.forward(k, v))
    cache.crop(cut)
    assert cache.offset == cut
    after_k, after_v = (t.clone() for t in cache.read())
    assert torch.equal(after_k, before_k[:, :, :cut]) and torch.equal(after_v, before_v[:, :, :cut])
    cache.crop(cut)  # repeat: no-op
    assert torch.equal(cache.read()[0], after_k)
    # cropping in two steps equals cropping once
    twin = CodecKVCache(codec=CODECS[tier])
    twin.forward(k, v)
    twin.crop(44)
    twin.crop(cut)
    assert torch.equal(twin.read()[0], after_k)
    assert cache.nbytes == sum(t.nbytes for t in cache.state)


@pytest.mark.parametrize("tier", CODECS)
def test_crop_then_new_tokens_keeps_earlier_blocks(tier):
    k = random_walk(s=64, seed=12)
    cache = CodecKVCache(codec=CODECS[tier])
    first = cache.forward(k, k)[0].clone()
    cache.crop(-27)  # transformers' convention: drop 27 from the end -> 37 kept
    assert cache.offset == 37
    out = cache.update_and_fetch(k[:, :, 37:50] * 3, k[:, :, 37:50])[0]
    codec = CODECS[tier]
    if codec.window_bits is None or (64 - codec.raw_window) // codec.block_size == 0:
        assert torch.equal(
            out[:, :, :32], first[:, :, :32]
        )  # the untouched blocks (or tail) are bitwise kept
    else:
        # the cut falls inside a block coded behind an int8 tail: its kept tokens go back to the
        # int8 tail (their decoded values, rounded once more), close to what they were
        assert (out[:, :, :32] - first[:, :, :32]).norm() <= 0.5 * (first[:, :, :32] - k[:, :, :32]).norm()


def test_lossless_crop_and_replay_reproduces_the_cache():
    k = random_walk(s=64, seed=13)
    cache = CodecKVCache(codec=CODECS["png-keep1"])
    first = cache.forward(k, k)[0].clone()
    cache.crop(29)
    again = cache.update_and_fetch(k[:, :, 29:], k[:, :, 29:])[0]
    assert torch.equal(again, first) and torch.equal(again, k)


@pytest.mark.parametrize("tier", CODECS)
def test_beam_search_gather(tier):
    b = 3
    k, v = random_walk(b=b, s=37, seed=14), random_walk(b=b, s=37, seed=15)
    cache = CodecKVCache(codec=CODECS[tier])
    before_k, before_v = (t.clone() for t in cache.forward(k, v))
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder(beam_idx)
    ok, ov = cache.read()
    assert torch.equal(ok, before_k[beam_idx]) and torch.equal(ov, before_v[beam_idx])
    # every buffer was gathered: continuing equals a cache fed the gathered history
    twin = CodecKVCache(codec=CODECS[tier])
    twin.forward(k[beam_idx], v[beam_idx])
    new_k, new_v = random_walk(b=b, s=9, seed=16), random_walk(b=b, s=9, seed=17)
    ak, av = cache.update_and_fetch(new_k, new_v)
    bk, bv = twin.update_and_fetch(new_k, new_v)
    assert torch.equal(ak, bk) and torch.equal(av, bv)
    assert [torch.equal(a, b) for a, b in zip(cache.state, twin.state, strict=True)] == [True] * len(
        cache.state
    )


def test_reorder_can_change_the_batch():
    k = random_walk(b=2, s=20, seed=18)
    cache = CodecKVCache(codec=CODECS["jpeg-k4"])
    ref = cache.forward(k, k)[0].clone()
    cache.reorder(torch.tensor([0, 0, 1, 1]))  # e.g. expanding for 2 beams
    assert cache.read()[0].shape[0] == 4
    assert torch.equal(cache.read()[0], ref.repeat_interleave(2, dim=0))
    cache.update_and_fetch(random_walk(b=4, s=1), random_walk(b=4, s=1))


@pytest.mark.parametrize("tier", LOSSY)
def test_lossy_tail_tokens_change_once_their_block_completes(tier):
    # why lossy tiers declare causal_stable=False to kvspec: the tail is raw (or int8 per token,
    # each token on its own), archived blocks are not
    w = CODECS[tier].raw_window  # a raw window delays the block by w tokens
    r = CODECS[tier].block_size
    k = random_walk(s=r + w, seed=19)
    coder = CODECS[tier].tail_coder
    stored = coder.decode(coder.encode(k), k.dtype)  # raw: k itself
    cache = CodecKVCache(codec=CODECS[tier])
    seen = cache.forward(k[:, :, : r - 1 + w], k[:, :, : r - 1 + w])[0].clone()
    assert torch.equal(seen, stored[:, :, : r - 1 + w])
    after = cache.decode_step(k[:, :, r - 1 + w :], k[:, :, r - 1 + w :])[0]
    assert not torch.equal(after[:, :, : r - 1], seen[:, :, : r - 1])
    assert torch.equal(after[:, :, r:], stored[:, :, r:])  # the window behind the block is unchanged


def test_lossless_tail_and_archive_agree_bit_for_bit_on_signed_zeros():
    # the raw tail stores -0.0 as +0.0 too, so no returned bit changes when the block completes
    k = random_walk(s=16, seed=20)
    k[:, :, 3, :4] = -0.0
    k[:, :, 9, 5] = -0.0
    cache = CodecKVCache(codec=CODECS["png-keep1"])
    seen = []
    for t in range(16):
        seen.append(cache.decode_step(k[:, :, t : t + 1], k[:, :, t : t + 1])[0].clone())
    final = seen[-1].view(torch.int32)
    for t, out in enumerate(seen):
        assert torch.equal(out.view(torch.int32), final[:, :, : t + 1])
    assert torch.equal(seen[-1], k)
