"""Keys per channel, values per token (KIVI's split), int4 or int8, with a window of newer tokens.

Real K/V are not alike. Keys carry a few outlier channels (large along the whole sequence), so a
quantization group that runs along the sequence, one channel at a time, gives each of them its own
range. Values have no such channels; what varies is the size of a token, so a group over the
channels of one token fits them (KIVI, Liu et al., 2024; figures for this repository's real model
in ``docs/flashcodec.md``).

:class:`KIVICodec` is the key codec (it stores blocks of ``r`` tokens per channel, as
:class:`~flashcodec.codecs.ChannelInt4Codec` does at 4 bits) and names its value codec in
:attr:`KIVICodec.value_codec`, a :class:`TokenIntCodec`; a cache codes its value stream with that
one (:attr:`BlockCodec.value_codec` is the codec itself for every other codec).

Stored parts per block (``PartSpec``; ``b`` bits, 4 or 8):

* keys: ``codes [r, D/2]`` uint8 (packed int4, codes ``-8..7``) or ``codes [r, D]`` int8 (codes
  ``-127..127``), ``scales [1, D]`` fp16, ``zeros [1, D]`` fp16: element ``(t, d)`` is
  ``code[t, d] * scale[d] + zero[d]``;
* values: the same codes, ``scales [r, 1]`` fp16, ``zeros [r, 1]`` fp16: element ``(t, d)`` is
  ``code[t, d] * scale[t] + zero[t]``.

At ``r = 64`` and ``D = 64`` both cost ``b + 0.5`` bits an element. Attention on the codes needs
no new kernel: the keys use the per-channel step of the kernels (``channel_affine``), the values
a scale and a zero point per stored row (``row_segments`` scales, ``row_offsets``), the rows
being the tokens themselves (``A`` is the identity).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from kvspec import KVConfigError

from .affine import ChannelAffine, RowAffine, TokenRows, channel_affine_specs, check_even, row_affine_specs
from .base import BlockCodec, PartSpec, check_block_size, to_blocks
from .quant import _pack_int4, packed_width, unpack_int4
from .tail import set_window_fields

__all__ = ["KIVICodec", "TokenIntCodec", "quantize_zero", "dequantize_zero", "CODE_BITS"]

#: the code widths the codecs here store: packed int4 (two codes a byte) or int8
CODE_BITS = (4, 8)
#: (lowest code, highest code) per width: int4 uses all 16 nibbles; int8 leaves -128 unused
#: (the state check refuses it, as for every int8 code of the package)
_CODE_RANGE = {4: (-8, 7), 8: (-127, 127)}
_FP16_MAX = float(torch.finfo(torch.float16).max)


def check_bits(name: str, bits: object, allowed: tuple[int, ...] = CODE_BITS) -> int:
    """``bits`` (one of ``allowed``: 4 or 8 by default) as an int; ``KVConfigError`` naming ``name`` otherwise."""
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or int(bits) not in allowed:
        raise KVConfigError(f"{name} must be one of {allowed}; got {bits!r}")
    return int(bits)


def quantize_zero(
    x: torch.Tensor, bits: int, dim: int, zero_at: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric ``bits``-bit codes of ``x [..., R, D]`` with an fp16 scale and zero point per slice
    along ``dim`` (``-2``: per channel, shared by the ``R`` rows; ``-1``: per row).

    Returns ``(codes, scale, zero)``: codes packed uint8 ``[..., R, ceil(D/2)]`` (4 bits) or int8
    ``[..., R, D]`` (8 bits); ``scale``, ``zero`` fp16 with ``dim`` reduced to 1, and
    ``codes * scale + zero`` within ``scale / 2`` of ``x``. The zero point is rounded to fp16 first
    and the scale then chosen (rounded up) to reach both ends of the slice from it, so the bound holds
    for the stored values (as :func:`~flashcodec.codecs.quant.quantize_int4_zero`, whose 4-bit codes
    these equal).

    ``zero_at``: None, or values of ``scale``'s shape to use as the zero points (rounded to fp16)
    instead of the middle of each slice: an element equal to its zero point is then stored as code
    0 and comes back as that fp16 value (the scale still reaches both ends of the slice from it).
    """
    lo_code, hi_code = _CODE_RANGE[bits]
    xf = x.to(torch.float32)
    lo, hi = torch.aminmax(xf, dim=dim, keepdim=True)
    steps = float(hi_code - lo_code)
    middle = lo - lo_code * (hi - lo) / steps if zero_at is None else zero_at.to(torch.float32)
    zero = middle.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).float()
    need = torch.maximum((zero - lo) / -lo_code, (hi - zero) / hi_code).clamp(0.0, _FP16_MAX / 2)
    scale = (need * (1.0 + 2.0**-10)).to(torch.float16)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(need))
    q = torch.round((xf - zero) / safe).clamp_(lo_code, hi_code)
    codes = _pack_int4(q) if bits == 4 else q.to(torch.int8)
    return codes, scale, zero.to(torch.float16)


def dequantize_zero(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``codes * scale + zero`` in fp32, cast to ``dtype``: packed uint8 codes (4 bits) are unpacked to
    ``dim`` channels; int8 codes are read as they are."""
    q = unpack_int4(codes, dim) if codes.dtype == torch.uint8 else codes
    return (q.to(torch.float32) * scale.float() + zero.float()).to(dtype)


def _code_spec(bits: int, rows: int, dim: int) -> PartSpec:
    if bits == 4:
        return PartSpec("codes", (rows, packed_width(dim)), torch.uint8)
    return PartSpec("codes", (rows, dim), torch.int8)


def _check_even(mode: str, bits: int, dim: int) -> None:
    if bits == 4:
        check_even(mode, dim)


def _dequantized(parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    codes, scale, zero = parts
    dim = 2 * codes.shape[-1] if codes.dtype == torch.uint8 else codes.shape[-1]
    return dequantize_zero(codes, scale, zero, dim, dtype)


def encode_with_sink(
    codec: BlockCodec,
    x: torch.Tensor,
    first_block: int,
    encode_sink_block: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, ...]:
    """A KIVI key codec's ``encode_blocks``: ``codec.encode(x)``, except that with its ``exact_sink``
    block 0 (``first_block == 0``) is coded by ``encode_sink_block(block [..., 1, r, D])``, which
    takes the block's first token as the zero point of every channel."""
    if not codec.exact_sink or first_block != 0 or x.shape[-2] == 0:
        return codec.encode(x)
    r = codec.block_size
    head = encode_sink_block(to_blocks(x[..., :r, :], r))
    if x.shape[-2] == r:
        return head
    rest = codec.encode(x[..., r:, :])
    return tuple(torch.cat([a, b], dim=-3) for a, b in zip(head, rest, strict=True))


@dataclass(frozen=True)
class TokenIntCodec(TokenRows, RowAffine):
    """Blocks of ``r`` tokens, each token in asymmetric ``bits``-bit codes with its own fp16 scale
    and zero point (a group over the channels of one token): :class:`KIVICodec`'s value codec.

    Args:
        block_size: ``r``, tokens per block (>= 1). Tokens are coded independently; the block is
            only the unit of the archive.
        bits: 4 (packed, two codes a byte; ``D`` even) or 8.
        raw_window, window_bits: the tail, as :class:`~flashcodec.codecs.ChannelInt4Codec`.
    """

    mode: ClassVar[str] = "token-int"

    block_size: int = 64
    bits: int = 4
    raw_window: int = 0
    window_bits: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", check_block_size(self.block_size))
        object.__setattr__(self, "bits", check_bits("bits", self.bits))
        set_window_fields(self)

    @property
    def int4_zero_nibble(self) -> bool:  # type: ignore[override]
        return self.bits == 4

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        return row_affine_specs(_code_spec(self.bits, self.block_size, dim), self.block_size)

    def check_dim(self, dim: int) -> None:
        _check_even(self.mode, self.bits, dim)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., n*r, D]`` -> ``(codes [..., n, r, D/2 or D], fp16 scales, fp16 zeros [..., n, r, 1])``."""
        return quantize_zero(to_blocks(x, self.block_size), self.bits, dim=-1)

    def _dequantize(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tokens ``[..., n, r, D]`` in ``dtype``."""
        return _dequantized(parts, dtype)


@dataclass(frozen=True)
class KIVICodec(TokenRows, ChannelAffine):
    """Keys in ``key_bits`` per (block, channel), values in ``value_bits`` per token (KIVI's split).

    This object codes the keys: blocks of ``r`` tokens in asymmetric codes with an fp16 scale and
    zero point per (block, channel). :attr:`value_codec` is the :class:`TokenIntCodec` of the
    values (the same ``block_size``, ``raw_window`` and ``window_bits``, so both streams hold the
    same blocks and tail).

    Args:
        block_size: ``r``, tokens per block (>= 1; 64 by default: 0.5 bits an element of metadata
            on each side).
        key_bits, value_bits: 4 (packed, ``D`` even) or 8.
        raw_window: newest tokens kept out of the blocks (an integer >= 0), as
            :class:`~flashcodec.codecs.ChannelInt4Codec`; default 64.
        window_bits: how the tail is stored: None in the input dtype, 8 in int8 per token (default).
        exact_sink: keep the key of the sequence's first token (the attention sink of most LLMs:
            on SmolLM2-135M it takes a quarter to over half of the attention from layer 12 on) as
            the fp16 zero point of each channel of block 0, so it is stored as code 0 and comes back
            as it went in (bf16 keys: bit for bit in their normal range); default True. No bytes:
            only block 0's zero points change, and its scales widen where token 0 is not central.
    """

    mode: ClassVar[str] = "kivi"

    block_size: int = 64
    key_bits: int = 4
    value_bits: int = 4
    raw_window: int = 64
    window_bits: int | None = 8
    exact_sink: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", check_block_size(self.block_size))
        if not isinstance(self.exact_sink, bool):
            raise KVConfigError(f"exact_sink must be a bool; got {self.exact_sink!r}")
        object.__setattr__(self, "key_bits", check_bits("key_bits", self.key_bits))
        object.__setattr__(self, "value_bits", check_bits("value_bits", self.value_bits))
        set_window_fields(self)

    @property
    def value_codec(self) -> TokenIntCodec:  # type: ignore[override]
        """The values' codec: per-token ``value_bits`` codes over the same blocks and tail."""
        return TokenIntCodec(self.block_size, self.value_bits, self.raw_window, self.window_bits)

    @property
    def int4_zero_nibble(self) -> bool:  # type: ignore[override]
        return self.key_bits == 4

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        return channel_affine_specs(_code_spec(self.key_bits, self.block_size, dim), dim)

    def check_dim(self, dim: int) -> None:
        _check_even(self.mode, self.key_bits, dim)
        self.value_codec.check_dim(dim)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Keys ``x [..., n*r, D]`` -> ``(codes, fp16 scales, fp16 zeros [..., n, 1, D])``; every block
        as a later block of a stream (no sink: see :meth:`encode_blocks`)."""
        return quantize_zero(to_blocks(x, self.block_size), self.key_bits, dim=-2)

    def encode_blocks(self, x: torch.Tensor, first_block: int) -> tuple[torch.Tensor, ...]:
        """:meth:`encode`, except that with :attr:`exact_sink` block 0 (``first_block == 0``) takes
        its first token as the zero point of every channel."""
        return encode_with_sink(self, x, first_block, self._encode_sink_block)

    def _encode_sink_block(self, block: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return quantize_zero(block, self.key_bits, dim=-2, zero_at=block[..., :1, :])

    def _dequantize(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """The key tokens ``[..., n, r, D]`` in ``dtype``."""
        return _dequantized(parts, dtype)
