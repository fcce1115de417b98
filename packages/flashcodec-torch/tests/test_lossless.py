"""The lossless exponent coder: bit for bit on every 16-bit pattern, smaller than the input on
K/V-like data, and its saved byte form round-trips."""

from __future__ import annotations

import pytest
import torch
from flashcodec.codecs.lossless import ExponentCoder, ExponentPacked
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError

DTYPES = [torch.bfloat16, torch.float16]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """All 65,536 values of the 16-bit format (zeros, subnormals, inf, NaNs), ``[4, 128, 128]``,
    shuffled so that groups mix magnitudes (many exceptions)."""
    u = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    u = u[torch.randperm(u.numel(), generator=torch.Generator().manual_seed(0))]
    return u.view(dtype).view(4, 128, 128)


@pytest.mark.parametrize("group", [2, 8, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_every_bit_pattern_round_trips_exactly(dtype, group):
    coder = ExponentCoder(group)
    x = every_pattern(dtype)
    packed = coder.encode(x)
    assert packed.exceptions > 0  # mixed magnitudes: the exception path is exercised
    assert torch.equal(bits(coder.decode(packed)), bits(x))
    again = ExponentPacked.from_bytes(packed.to_bytes(level=1))
    assert torch.equal(bits(coder.decode(again)), bits(x))


@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (2, 3, 70, 16), (1, 2, 1, 2, 129, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_shapes_with_partial_groups_round_trip(dtype, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    x.view(-1)[0] = 0.0  # a zero and a negative zero among the values
    if x.numel() > 1:
        x.view(-1)[1] = -0.0
    coder = ExponentCoder(64)
    out = coder.decode(coder.encode(x))
    assert out.shape == x.shape and out.dtype == dtype and torch.equal(bits(out), bits(x))


def test_kv_like_bf16_shrinks_below_080():
    """Gaussian channels with per-channel scales (real K/V's shape): 4 + 8 bits an element plus
    one byte per 64 tokens and channel, i.e. about 0.76 of the raw bytes; zlib takes the saved
    form lower still."""
    g = torch.Generator().manual_seed(2)
    scale = torch.exp(torch.randn(1, 3, 1, 64, generator=g))
    x = (torch.randn(2, 3, 512, 64, generator=g) * scale).to(torch.bfloat16)
    packed = ExponentCoder(64).encode(x)
    assert packed.raw_nbytes == x.nbytes
    assert packed.nbytes <= 0.77 * x.nbytes, packed.nbytes / x.nbytes
    assert len(packed.to_bytes()) < packed.nbytes
    assert torch.equal(bits(ExponentCoder.decode(packed)), bits(x))


def test_exceptions_are_listed_and_restored():
    x = torch.ones(1, 64, 2, dtype=torch.bfloat16)
    x[0, 5, 0] = 2.0**-30  # 30 binades below its group's maximum: a listed exception
    x[0, 6, 0] = 0.0  # exponent field 0: code 15, not an exception
    packed = ExponentCoder(64).encode(x)
    assert packed.exceptions == 1 and packed.exc_exponent.tolist() == [127 - 30]
    assert torch.equal(bits(ExponentCoder.decode(packed)), bits(x))


def test_bad_inputs_are_rejected():
    coder = ExponentCoder()
    with pytest.raises(KVDtypeError, match="bfloat16 or float16"):
        coder.encode(torch.zeros(4, 4))
    with pytest.raises(KVDtypeError, match="torch.Tensor"):
        coder.encode([1.0])
    with pytest.raises(KVShapeError, match=r"\[\.\.\., S, D\]"):
        coder.encode(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(KVShapeError):
        coder.encode(torch.zeros(0, 4, dtype=torch.bfloat16))
    for bad in (3, 0, 1.5, True, "64"):
        with pytest.raises(KVConfigError, match="group"):
            ExponentCoder(bad)
    with pytest.raises(KVDtypeError, match="ExponentPacked"):
        coder.decode(torch.zeros(2))
    packed = coder.encode(torch.zeros(2, 2, dtype=torch.bfloat16))
    for level in (-1, 10, 2.0, True):
        with pytest.raises(KVConfigError, match="level"):
            packed.to_bytes(level)
    with pytest.raises(KVDataError, match="magic"):
        ExponentPacked.from_bytes(b"not a packed tensor")
    data = packed.to_bytes()
    with pytest.raises(KVDataError, match="damaged"):
        ExponentPacked.from_bytes(data[:-3])
    with pytest.raises(KVDtypeError):
        ExponentPacked.from_bytes("text")
