"""A stream's sink: the sequence's first tokens kept apart in the tail's form once block 0 is archived.

``RotatedKIVICodec(..., value_sink_tokens=k)`` gives the value stream a sink of ``k`` tokens (int8
per token behind an int8 window): the values of the attention sink keep the window's precision
instead of block 0's 2-4-bit codes, for a few bytes. These tests check the stream's contract
(reads, bytes, crop, reorder, undo, saved state and its checks) and attention on the codes.
"""

from __future__ import annotations

import pytest
import torch
from flashcodec import CodecKVCache
from flashcodec.attention import (
    codec_decode_attention,
    codec_prefill_attention,
    materialized_decode_attention,
    materialized_prefill_attention,
)
from flashcodec.codecs.rotated import RotatedKIVICodec
from flashcodec.stream import CodecStream
from kvspec import KVConfigError, KVDataError

B, H, D, R = 2, 2, 16, 8


def _codec(sink: int = 1, **options) -> RotatedKIVICodec:
    base = dict(key_bits=4, value_bits=2, raw_window=8, side_bits=8, value_sink_tokens=sink)
    return RotatedKIVICodec(R, **{**base, **options})


def _kv(s: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, s, D, generator=gen).to(torch.bfloat16)
    values = torch.randn(B, H, s, D, generator=gen)
    values[:, :, 0] *= 12  # a large first value, as an attention sink's often is
    return keys, values.to(torch.bfloat16)


def _filled(codec: RotatedKIVICodec, s: int = 40, step: int | None = None) -> CodecKVCache:
    keys, values = _kv(s)
    cache = CodecKVCache(codec=codec)
    if step is None:
        cache.append(keys, values)
    else:
        for i in range(0, s, step):
            cache.append(keys[:, :, i : i + step], values[:, :, i : i + step])
    return cache


def test_the_sink_holds_the_first_values_at_the_windows_precision_and_nothing_else_changes():
    keys, values = _kv(40)
    plain, sunk = _filled(_codec(0)), _filled(_codec(2))
    a, b = plain.values.read(), sunk.values.read()
    assert sunk.values.sink_len == 2 and plain.values.sink_len == 0 and sunk.keys.sink_len == 0
    assert torch.equal(a[:, :, 2:], b[:, :, 2:])  # block 0's codes and every later token unchanged
    err_plain = (a[:, :, :2].float() - values[:, :, :2].float()).abs().max()
    err_sink = (b[:, :, :2].float() - values[:, :, :2].float()).abs().max()
    assert err_sink < err_plain / 8, (err_sink, err_plain)  # int8 against 2-bit codes
    window = sunk.values.codec.tail_coder
    assert torch.equal(b[:, :, :2], window.decode(window.encode(values[:, :, :2]), torch.bfloat16))
    assert torch.equal(plain.keys.read(), sunk.keys.read())


def test_with_a_raw_window_the_sink_holds_the_first_values_bit_for_bit():
    keys, values = _kv(40)
    cache = CodecKVCache(codec=_codec(1, window_bits=None))
    cache.append(keys, values)
    assert [spec.name for spec in cache.codec.value_codec.sink_specs(D)] == ["sink"]
    assert torch.equal(cache.values.read()[:, :, :1], values[:, :, :1])
    restored = CodecKVCache.from_state(cache.state, cache.meta_state)
    assert torch.equal(restored.values.read(), cache.values.read())


def test_the_sink_costs_its_int8_tokens_and_counts_in_held_bytes():
    plain, sunk = _filled(_codec(0)), _filled(_codec(3))
    extra = sunk.storage_bytes().held - plain.storage_bytes().held
    assert extra == B * H * 3 * (D + 4 + 4)  # uint8 codes + an fp32 scale and zero point a token
    assert sum(t.nbytes for t in sunk.state) == sunk.storage_bytes().held


def test_the_sink_is_the_same_whether_the_first_tokens_came_in_one_step_or_one_by_one():
    # (block 0's codes differ: one by one, its tokens waited in the int8 window first)
    at_once, one_by_one = _filled(_codec(1)), _filled(_codec(1), step=1)
    for a, b in zip(at_once.values.sink_parts(), one_by_one.values.sink_parts(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(at_once.values.read()[:, :, :1], one_by_one.values.read()[:, :, :1])


def test_no_sink_before_block_zero_is_archived():
    cache = _filled(_codec(1), s=R + 8 - 1)  # one token short of archiving block 0
    assert cache.values.n_blocks == 0 and cache.values.sink_len == 0
    sink_specs = cache.codec.value_codec.sink_specs(D)
    assert [spec.name for spec in sink_specs] == ["sink_codes", "sink_scales", "sink_zeros"]
    restored = CodecKVCache.from_state(cache.state, cache.meta_state)
    assert torch.equal(restored.values.read(), cache.values.read())


def test_state_round_trip_and_the_codec_in_meta_state():
    cache = _filled(_codec(2), s=45, step=5)
    restored = CodecKVCache.from_state(cache.state, cache.meta_state)
    assert restored.codec == cache.codec and restored.codec.value_sink_tokens == 2
    assert restored.values.sink_len == 2
    assert torch.equal(restored.values.read(), cache.values.read())
    assert torch.equal(restored.keys.read(), cache.keys.read())


def test_a_state_whose_sink_does_not_fit_is_refused():
    cache = _filled(_codec(2))
    state = list(cache.state)
    n_keys = len(cache.codec.stream_state_specs(1))
    n_parts = len(cache.codec.value_codec.part_specs(1))
    at = n_keys + n_parts  # the values' first sink array
    for bad in (state[at][:, :, :1], state[at][:, :, :0]):
        edited = [*state[:at], bad, *state[at + 1 :]]
        with pytest.raises(KVDataError, match="sink_codes"):
            CodecKVCache.from_state(edited, cache.meta_state)
    negative = [*state]
    negative[at + 1] = -state[at + 1] - 1  # a negative scale
    with pytest.raises(KVDataError, match="sink_scales"):
        CodecKVCache.from_state(negative, cache.meta_state)


def test_crop_into_block_zero_drops_the_sink_and_a_later_crop_keeps_it():
    cache = _filled(_codec(1), s=40)
    before = cache.values.read().clone()
    cache.crop(2 * R)
    assert cache.values.sink_len == 1 and torch.equal(cache.values.read(), before[:, :, : 2 * R])
    cache.crop(R // 2)  # inside block 0: its first tokens return to the tail, the sink's among them
    assert cache.values.n_blocks == 0 and cache.values.sink_len == 0
    assert torch.equal(cache.values.read()[:, :, :1], before[:, :, :1])
    restored = CodecKVCache.from_state(cache.state, cache.meta_state)
    assert torch.equal(restored.values.read(), cache.values.read())


def test_reorder_gathers_the_sink_with_the_batch():
    cache = _filled(_codec(1))
    before = cache.values.read().clone()
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.values.sink_parts()[0][0], cache.values.sink_parts()[0][1])
    assert torch.equal(cache.values.read()[0], before[1])


def test_an_undone_append_takes_the_sink_back():
    keys, values = _kv(40)
    stream = CodecStream(_codec(1).value_codec, B, H, D, torch.bfloat16, "cpu")
    stream.append(values[:, :, :10])
    state = stream.state()
    undo = stream.commit_append(stream.prepare_append(values[:, :, 10:30]))  # archives block 0
    assert stream.sink_len == 1
    undo()
    assert stream.sink_len == 0 and stream.n_blocks == 0
    for a, b in zip(stream.state(), state, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rotate", [True, False])
def test_attention_on_the_codes_reads_the_sink(rotate):
    cache = _filled(_codec(1, rotate_keys=rotate, rotate_values=rotate), s=45, step=9)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(B, 2 * H, 1, D, generator=gen).to(torch.bfloat16)
    mask = torch.zeros(B, 45)
    mask[-1, :3] = float("-inf")  # padding over the sink itself in one sequence
    got = codec_decode_attention(query, cache.keys, cache.values, key_mask=mask, backend="torch")
    want = materialized_decode_attention(query, cache.keys, cache.values, key_mask=mask)
    assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    steps = torch.randn(B, 2 * H, 6, D, generator=gen).to(torch.bfloat16)
    got = codec_prefill_attention(steps, cache.keys, cache.values, chunk_blocks=2)
    want = materialized_prefill_attention(steps, cache.keys, cache.values)
    assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    # the sink changes the output: without it the first value is block 0's 2-bit code
    plain = _filled(_codec(0, rotate_keys=rotate, rotate_values=rotate), s=45, step=9)
    other = codec_decode_attention(query, plain.keys, plain.values, backend="torch")
    assert not torch.equal(other, codec_decode_attention(query, cache.keys, cache.values, backend="torch"))


@pytest.mark.parametrize("bad", [-1, R + 1, True, 1.0, "1"])
def test_bad_sink_lengths_are_refused(bad):
    with pytest.raises(KVConfigError, match="value_sink_tokens"):
        _codec(bad)
