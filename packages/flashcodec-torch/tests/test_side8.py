"""8-bit side information of the rotated KIVI codecs (``side_bits=8``): log-coded scales against an
fp16 base per block, int8 zero points in half steps; the ``-s8`` tiers."""

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
from flashcodec.codecs.quant import unpack_int4
from flashcodec.codecs.rotated import (
    SCALE_LOG_STEPS,
    RotatedKIVICodec,
    RotatedTokenIntCodec,
    quantize_bits,
    quantize_side8,
    side8_values,
    unpack_codes,
)
from flashcodec.tiers import TIERS, tier
from kvspec import KVConfigError, KVDataError
from test_rotated import assert_triton_matches_torch, kv


def _levels(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    if bits < 4:
        return unpack_codes(codes, bits, dim).float()
    return (unpack_int4(codes, dim) if bits == 4 else codes).float()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [-1, -2])
@pytest.mark.parametrize("zero_bits", [8, 16])
def test_every_element_is_within_half_a_step(bits, dim, zero_bits):
    g = torch.Generator().manual_seed(bits)
    # slices of very different sizes in one block, some far from 0, one constant
    x = torch.randn(3, 4, 16, 32, generator=g) * torch.rand(3, 4, 16, 1, generator=g).mul(20)
    x = x + torch.randn(3, 4, 1, 32, generator=g) * 6
    x[0, 0] = 2.5
    codes, scale, zero, base = quantize_side8(x, bits, dim, zero_bits)
    assert scale.dtype == torch.uint8 and base.dtype == torch.float16 and base.shape == (3, 4, 1, 1)
    assert zero.dtype == (torch.int8 if zero_bits == 8 else torch.float16)
    s, z = side8_values(scale, zero, base)
    back = _levels(codes, bits, 32) * s + z
    assert ((back - x).abs() <= s / 2 * (1 + 1e-5) + 1e-6).all()
    assert int(zero.min()) >= -127 if zero_bits == 8 else True


@pytest.mark.parametrize("bits", [2, 3])
def test_four_bit_zero_points_pack_two_rows_a_byte_and_stay_within_half_a_step(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 16, 32, generator=g) * torch.rand(2, 3, 16, 1, generator=g).mul(5)
    x[0, 0, 3] += 40  # a token far from 0: a coarser step, still every element within half of it
    codes, scale, zero, base = quantize_side8(x, bits, -1, 4)
    assert zero.dtype == torch.uint8 and zero.shape == (2, 3, 8, 1)
    assert ((zero & 15) > 0).all() and ((zero >> 4) > 0).all()  # nibbles z + 8 in 1..15
    s, z = side8_values(scale, zero, base)
    back = _levels(codes, bits, 32) * s + z
    assert ((back - x).abs() <= s / 2 * (1 + 1e-5) + 1e-6).all()
    wide = quantize_side8(x, bits, -1, 8)
    s8 = side8_values(*wide[1:])[0]
    assert s[0, 0, 3] > s8[0, 0, 3]  # only the far token paid for the short zero point
    assert torch.equal(s[1], s8[1])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_scales_are_the_fp16_ones_rounded_up_by_one_log_step_at_most(bits):
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 3 + 1
    _, s16, z16 = quantize_bits(x, bits, -2)
    codes, scale, zero, base = quantize_side8(x, bits, -2, 16)
    s8, z8 = side8_values(scale, zero, base)
    assert torch.equal(z8, z16.float())  # same fp16 zero points
    ratio = s8 / s16.float()
    assert (ratio >= 1 - 2e-3).all() and (ratio <= 2 ** (1 / SCALE_LOG_STEPS) * (1 + 2e-3)).all()


@pytest.mark.parametrize("key_bits,value_bits", [(3, 2), (3, 3), (8, 8)])
def test_round_trip_costs_little_more_than_fp16_side_information(key_bits, value_bits):
    k, v = kv(s=256, d=64)
    for exact_sink in (True, False):
        small = RotatedKIVICodec(64, key_bits, value_bits, raw_window=0, exact_sink=exact_sink, side_bits=8)
        full = RotatedKIVICodec(64, key_bits, value_bits, raw_window=0, exact_sink=exact_sink)
        for a, b, x in ((small, full, k), (small.value_codec, full.value_codec, v)):
            err_small = (a.decode(a.encode_blocks(x, 0), torch.float32) - x).norm()
            err_full = (b.decode(b.encode_blocks(x, 0), torch.float32) - x).norm()
            # keys without the sink get a coarser step where a channel sits far from 0
            bound = 1.3 if a is small and not exact_sink and key_bits == 8 else 1.12
            assert err_full <= err_small * 1.001 and err_small < bound * err_full, (a, err_small, err_full)


def test_four_bit_value_zero_points_cost_little_on_rotated_values():
    _, v = kv(s=256, d=64)
    errs = {}
    for zero_bits in (8, 4):
        codec = RotatedTokenIntCodec(64, 2, side_bits=8, zero_bits=zero_bits)
        errs[zero_bits] = (codec.roundtrip(v) - v).norm()
    assert errs[8] <= errs[4] < 1.03 * errs[8]


def test_storage_is_measured_from_the_arrays_and_halves_the_side_information():
    k, v = kv(b=1, h=2, s=64 * 3 + 20, d=64, dtype=torch.bfloat16)
    for exact_sink, key_zero in ((True, 2), (False, 1)):
        cache = CodecKVCache(
            codec=RotatedKIVICodec(64, 3, 2, raw_window=0, exact_sink=exact_sink, side_bits=8)
        )
        cache.append(k, v)
        st = cache.storage_bytes()
        assert st.held == sum(t.nbytes for t in cache.state)
        # per block and head: codes, a uint8 scale and a zero point per channel (keys) or per
        # token (values), one fp16 base
        key_block = 64 * 24 + 64 * (1 + key_zero) + 2
        value_block = 64 * 16 + 64 * 2 + 2
        assert st.used == 2 * 3 * (key_block + value_block)
        assert st.tail == 2 * 2 * 20 * (64 + 8)  # the incomplete block, int8 per token
    cache = CodecKVCache(codec=RotatedKIVICodec(64, 3, 2, raw_window=0, side_bits=8, value_zero_bits=4))
    cache.append(k, v)
    assert cache.storage_bytes().used == 2 * 3 * (64 * 24 + 64 * 3 + 2 + 64 * 16 + 64 + 32 + 2)


def test_exact_sink_holds_the_first_key_with_8_bit_scales():
    k, v = kv(d=64, s=150, dtype=torch.bfloat16)
    sink, _ = CodecKVCache(codec=RotatedKIVICodec(16, 2, 2, raw_window=0, side_bits=8)).update_and_fetch(k, v)
    plain, _ = CodecKVCache(
        codec=RotatedKIVICodec(16, 2, 2, raw_window=0, side_bits=8, exact_sink=False)
    ).update_and_fetch(k, v)
    first = (sink.float() - k.float()).abs().amax(-1)[:, :, 0]
    assert (first <= 4e-3 * k[:, :, 0].float().abs().amax(-1)).all()
    assert ((plain.float() - k.float()).abs().amax(-1)[:, :, 0] > 10 * first).all()


CONFIGS = {
    "k3v2-s8": RotatedKIVICodec(64, 3, 2, raw_window=0, side_bits=8),
    "k3v2-s8n": RotatedKIVICodec(64, 3, 2, raw_window=0, side_bits=8, exact_sink=False),
    "k8v8-s8-raw-window": RotatedKIVICodec(64, 8, 8, raw_window=32, window_bits=None, side_bits=8),
    "k4v4-s8-keys-only": RotatedKIVICodec(16, 4, 4, rotate_values=False, side_bits=8),
    "k3v2-s8z4": RotatedKIVICodec(64, 3, 2, raw_window=0, side_bits=8, value_zero_bits=4),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_attention_on_the_codes_equals_decode_then_attend(name):
    k, v = kv(b=2, h=2, s=64 * 3 + 45, d=64)
    cache = CodecKVCache(codec=CONFIGS[name])
    cache.append(k, v)
    q = torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, cache.offset, dtype=torch.bool)
    mask[1, :40] = False
    for key_mask in (None, mask):
        got = codec_decode_attention(q, cache.keys, cache.values, key_mask=key_mask, backend="torch")
        want = materialized_decode_attention(q, cache.keys, cache.values, key_mask=key_mask)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        cache.keys.release_view(), cache.values.release_view()
    qs = torch.randn(2, 6, 5, 64, generator=torch.Generator().manual_seed(2))
    got = codec_prefill_attention(qs, cache.keys, cache.values)
    want = materialized_prefill_attention(qs, cache.keys, cache.values)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_state_round_trip_and_a_corrupt_base_is_refused():
    k, v = kv(s=150, d=32, dtype=torch.bfloat16)
    codec = RotatedKIVICodec(32, 3, 2, raw_window=20, side_bits=8, exact_sink=False)
    cache = CodecKVCache(codec=codec)
    cache.append(k, v)
    again = CodecKVCache.from_state(cache.state, cache.meta_state)
    assert again.codec == codec and again.values.codec == codec.value_codec
    more_k, more_v = kv(s=40, d=32, seed=3, dtype=torch.bfloat16)
    a, b = cache.update_and_fetch(more_k, more_v), again.update_and_fetch(more_k, more_v)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    names = [spec.name for spec in codec.stream_state_specs(1)]
    state = list(cache.state)
    at = names.index("scale_base")
    for bad in (-1.0, float("nan")):
        state[at] = cache.state[at].clone()
        state[at].view(-1)[0] = bad
        with pytest.raises(KVDataError, match="scale_base"):
            CodecKVCache.from_state(tuple(state), cache.meta_state)
    # the refusals changed nothing: the cache still equals its twin
    assert all(torch.equal(x, y) for x, y in zip(cache.state, again.state, strict=True))


@pytest.mark.parametrize(
    "options,match",
    [
        (
            {"side_bits": 4},
            r"side_bits must be one of \(16, 8\) \(how scales and zero points are stored\); got 4",
        ),
        ({"side_bits": True}, r"side_bits must be one of"),
        ({"side_bits": 8.0}, r"side_bits must be one of"),
        (
            {"side_bits": 8, "range_fit": "gauss"},
            r"side_bits=8 fits its levels min-max only; got range_fit='gauss'",
        ),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(KVConfigError, match=match):
        RotatedKIVICodec(**options)
    with pytest.raises(KVConfigError, match=match):
        RotatedTokenIntCodec(**options)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"zero_bits": 2}, r"zero_bits must be 8 or 4 \(bits of a per-token zero point\); got 2"),
        (
            {"zero_bits": 4},
            r"zero_bits=4 packs two tokens' zero points a byte: it needs side_bits=8 .*side_bits=16",
        ),
        (
            {"zero_bits": 4, "side_bits": 8, "block_size": 7},
            r"an even block_size; got side_bits=8, block_size=7",
        ),
    ],
)
def test_bad_zero_bits(options, match):
    with pytest.raises(KVConfigError, match=match):
        RotatedTokenIntCodec(**options)
    kivi = {("value_zero_bits" if k == "zero_bits" else k): val for k, val in options.items()}
    with pytest.raises(KVConfigError, match=match.replace("zero_bits", "value_zero_bits")):
        RotatedKIVICodec(**kivi)


def test_the_s8_tiers_name_their_codecs():
    for name in ("kivi64r-k3v2-w0i8-s8z4", "kivi64r-k8v8-w32-s8", "kivi64r-k4v4-w64i8-s8"):
        t = TIERS[name]
        assert (
            t.codec.side_bits == 8 and t.attention == "codes" and tier(name, "materialized").codec == t.codec
        )
    assert TIERS["kivi64r-k3v2-w0i8-s8z4"].codec.value_codec.zero_bits == 4
    assert TIERS["kivi64r-k8v8-w32-s8"].codec.window_bits is None


@pytest.mark.slow
def test_triton_kernel_matches_the_reference_under_the_interpreter():
    """The Triton kernel reads the expanded 8-bit side information as it reads fp16's."""
    assert_triton_matches_torch(
        "((RotatedKIVICodec(16, 3, 2, raw_window=0, side_bits=8, value_zero_bits=4), torch.float32),"
        " (RotatedKIVICodec(16, 8, 8, raw_window=8, window_bits=None, side_bits=8, exact_sink=False),"
        " torch.bfloat16))",
        s=45,
    )
