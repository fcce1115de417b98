"""Per-channel int4: each block of ``r`` tokens quantized channel by channel (KIVI's key grouping).

A block of ``r`` tokens (64 by default) is stored as ``r x D`` int4 codes with one fp16 scale and
one fp16 zero point per channel of the block: element ``(t, d)`` is ``code[t, d] * scale[d] +
zero[d]``. At ``r = 64`` that is the bytes of ``jpeg-int4z`` (4 bits an element plus 32 bits per 64
elements), grouped the other way: a quantization group runs along the sequence, one channel at a
time, instead of across the channels of one (DCT) row.

Why: K/V activations have outlier channels, whose range a row-wise group shares with every quiet
channel of the row; a group along the sequence gives each channel its own range (KIVI, Liu et
al., 2024, groups keys this way for that reason). On the embedded model, with an int8 window, it
has a lower KL than the DCT-row codes at the same bytes (``docs/flashcodec.md``, "int4 with a
window beside hqq").

Stored parts per block (``PartSpec``): ``codes [r, ceil(D/2)]`` uint8 (packed int4, codes ``-8..7``,
see :mod:`flashcodec.codecs.quant`), ``scales [1, D]`` fp16, ``zeros [1, D]`` fp16.

Attention on the codes: the stored rows are the block's tokens (``A`` is the identity) without a
row scale; the kernels apply the per-channel scale to the query (``q . (c * s + z) = (q * s) . c
+ q . z``) and to the weighted codes on the value side (:meth:`channel_affine`,
``flashcodec.kernels.naive.CodedRows.channel_scales``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .affine import ChannelAffine, TokenRows, channel_affine_specs, check_even
from .base import PartSpec, check_block_size, to_blocks
from .quant import dequantize_int4_zero, packed_width, quantize_int4_zero
from .tail import set_window_fields

__all__ = ["ChannelInt4Codec"]


@dataclass(frozen=True)
class ChannelInt4Codec(TokenRows, ChannelAffine):
    """Blocks of ``r`` tokens in asymmetric int4, an fp16 scale and zero point per (block, channel).

    Args:
        block_size: ``r``, tokens per block (>= 1; 64 by default: 0.5 bits an element of metadata).
        raw_window: newest tokens kept out of the blocks, an integer >= 0; default 0 (as
            :class:`~flashcodec.codecs.ZeroPointJPEGCodec`: the tail then holds ``raw_window`` to
            ``raw_window + r - 1`` tokens).
        window_bits: how the tail is stored: None (the default) in the input dtype, bit for bit;
            8 in int8 per token (:class:`~flashcodec.codecs.tail.Uint8Tail`).

    ``D`` must be even (two codes a byte). Arithmetic in fp32; :meth:`decode` returns the
    requested dtype.
    """

    mode: ClassVar[str] = "chan-int4"
    int4_zero_nibble: ClassVar[bool] = True

    block_size: int = 64
    raw_window: int = 0
    window_bits: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", check_block_size(self.block_size))
        set_window_fields(self)

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        return channel_affine_specs(PartSpec("codes", (self.block_size, packed_width(dim)), torch.uint8), dim)

    def check_dim(self, dim: int) -> None:
        check_even(self.mode, dim)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., n*r, D]`` -> ``(uint8 codes [..., n, r, D/2], fp16 scales, fp16 zeros [..., n, 1, D])``."""
        return quantize_int4_zero(to_blocks(x, self.block_size), dim=-2)

    def _dequantize(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tokens ``[..., n, r, D]`` in ``dtype`` (codes times the channel's scale plus its zero)."""
        q, scale, zero = parts
        return dequantize_int4_zero(q, scale, zero, 2 * q.shape[-1], dtype)
