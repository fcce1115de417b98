"""Mixed-bit coder: real packing, segment layout from the policy, bounded quantization error."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from palu_helpers import gaussian
from palu_mlx import FixedSplitPolicy, MixedBitCoder, Segment, UniformPolicy
from palu_mlx.mixed_bit import pack_codes, unpack_codes


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n", [1, 7, 16, 33])
def test_pack_unpack_round_trip(bits, n):
    rng = np.random.default_rng(bits * 100 + n)
    codes = mx.array(rng.integers(0, 1 << bits, size=(3, n)), dtype=mx.uint32)
    words = pack_codes(codes, bits)
    per_word = 8 // bits if 8 % bits == 0 else 32 // bits
    assert words.shape == (3, -(-n // per_word))
    assert words.dtype == (mx.uint8 if 8 % bits == 0 else mx.uint32)
    assert np.array_equal(np.array(unpack_codes(words, bits, n)), np.array(codes))


def test_fixed_split_policy():
    sv = np.ones((4, 16))
    assert FixedSplitPolicy(4, 2, 0.25).allocate(sv) == (Segment(0, 4, 4), Segment(4, 16, 2))
    assert FixedSplitPolicy(4, 2, 0.0).allocate(sv) == (Segment(0, 16, 2),)
    assert FixedSplitPolicy(4, 2, 1.0).allocate(sv) == (Segment(0, 16, 4),)
    assert FixedSplitPolicy(4, 4, 0.5).allocate(sv) == (Segment(0, 16, 4),)  # merged
    assert FixedSplitPolicy(8, 2, 0.1).allocate(np.ones((1, 5))) == (Segment(0, 1, 8), Segment(1, 5, 2))


def test_codes_are_packed_and_bytes_match_the_layout():
    coder = MixedBitCoder((Segment(0, 4, 4), Segment(4, 16, 2)), group_size=32, store_dtype=mx.float16)
    coded = coder.encode(gaussian((2, 3, 5, 16)))
    assert coded["seg0.codes"].dtype == mx.uint8 and coded["seg0.codes"].shape == (2, 3, 5, 2)
    assert coded["seg1.codes"].shape == (2, 3, 5, 3)
    assert coded["seg0.scales"].dtype == mx.float16 and coded["seg0.scales"].shape == (2, 3, 5, 1)
    per_row = sum(a.nbytes for a in coded.values()) // (2 * 3 * 5)
    assert per_row == 2 + 3 + 4 * 2  # codes (4x4 + 12x2 bits) + one fp16 scale and bias per segment
    assert coder.assigned_avg_bits == pytest.approx((4 * 4 + 12 * 2) / 16)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantization_error_is_within_half_a_step(bits):
    x = gaussian((1, 2, 40, 24), seed=bits)
    coder = MixedBitCoder((Segment(0, 24, bits),), group_size=10, store_dtype=mx.float32)  # 10, 10, 4
    x_hat = coder.decode(coder.encode(x))
    groups = np.pad(np.array(x), [(0, 0)] * 3 + [(0, 6)], mode="edge").reshape(1, 2, 40, 3, 10)
    step = (groups.max(-1) - groups.min(-1)) / ((1 << bits) - 1)
    bound = np.repeat(step, 10, axis=-1)[..., :24] / 2 + 1e-5
    assert np.all(np.abs(np.array(x_hat) - np.array(x)) <= bound)


def test_more_bits_less_error_and_unquantized_is_exact():
    x = gaussian((1, 2, 64, 16), seed=9)
    errs = []
    for bits in (1, 2, 4, 8):
        coder = MixedBitCoder(UniformPolicy(bits).allocate(np.ones((1, 16))), 16, mx.float32)
        errs.append(mx.mean((coder.decode(coder.encode(x)) - x) ** 2).item())
    assert errs == sorted(errs, reverse=True)
    exact = MixedBitCoder(UniformPolicy(16).allocate(np.ones((1, 16))), 16, mx.float32)
    assert mx.array_equal(exact.decode(exact.encode(x)), x).item()


def test_each_token_is_coded_independently():
    x = gaussian((1, 1, 10, 16), seed=3)
    coder = MixedBitCoder((Segment(0, 4, 4), Segment(4, 16, 2)), 8, mx.float16)
    whole = coder.decode(coder.encode(x))
    part = coder.decode(coder.encode(x[:, :, :6]))
    assert mx.array_equal(whole[:, :, :6], part).item()


def test_segment_fields_are_plain_ints():
    # a policy may build segments from numpy ints; meta_state writes them as JSON
    seg = Segment(np.int64(0), np.int64(4), np.int32(2))
    assert all(type(v) is int for v in (seg.start, seg.stop, seg.bits))
    assert seg == Segment(0, 4, 2)


def test_pack_codes_checks_before_it_can_clobber_a_neighbour():
    from kvspec import KVValueError

    codes = mx.array([[3, 0, 3, 0]], dtype=mx.uint32)
    assert np.array_equal(np.array(unpack_codes(pack_codes(codes, 2), 2, 4)), np.array(codes))
    with pytest.raises(KVValueError, match=r"\[0, 4\]"):
        pack_codes(
            mx.array([[4, 0, 3, 0]], dtype=mx.uint32), 2
        )  # 4 needs 3 bits: it would set the next field
