"""JPEG with asymmetric int4: block DCT-II, every kept row quantized with its own scale and zero point.

Same transform as :class:`~flashcodec.codecs.jpeg.JPEGCodec` (``C = M X`` per block of ``r``
tokens, keep the lowest ``K`` frequencies) and the same bytes as its ``quant_bits=4``: ``D / 2``
bytes of codes plus 4 bytes per (block, frequency) row. Where ``JPEGCodec`` spends those 4 bytes
on one fp32 scale of a symmetric range ``[-max, max]`` (15 levels), this codec spends them on an
fp16 scale and an fp16 zero point (16 levels over ``[min, max]``). On the embedded model that
halves the KL of the int4 tier at the same bytes (2.2e-3 to 1.1e-3,
``benchmarks/results/flashcodec_int4_study.json``); a likely reason, not measured on its own, is
the DC row of the keys, which carries each channel's offset and is far from centred on 0.

Stored parts per block (``PartSpec``): ``coeffs [K, ceil(D/2)]`` uint8 (packed int4, codes
``-8..7``, see :mod:`flashcodec.codecs.quant`), ``scales [K, 1]`` fp16, ``zeros [K, 1]`` fp16;
row ``j`` is ``coeffs[j] * scales[j] + zeros[j]``.

Attention on the codes: the zero point adds ``zero_j * sum(q)`` to the dot product of a query with
row ``j`` and ``zero_j`` times the row's weight to every output element, which the kernels add
from :meth:`row_offsets` (``flashcodec.kernels.naive.CodedRows.offsets``) without unpacking more.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch
from kvspec import KVConfigError

from .affine import RowAffine, check_even, row_affine_specs
from .base import PartSpec, check_block_size, compute_dtype, from_blocks, to_blocks, to_output
from .jpeg import JPEGCodec
from .quant import dequantize_int4_zero, packed_width, quantize_int4_zero
from .tail import set_window_fields

__all__ = ["ZeroPointJPEGCodec"]


@dataclass(frozen=True)
class ZeroPointJPEGCodec(RowAffine):
    """Block DCT-II codec, ``K`` rows per block in asymmetric int4 (fp16 scale and zero per row).

    Args:
        block_size: ``r``, tokens per block (>= 1).
        keep_freqs: ``K`` in ``1..r``; ``None`` (the default) means ``r``. Stored resolved.
        raw_window: newest tokens kept raw (uncoded), an integer >= 0; default 0. A block is coded
            once ``raw_window`` newer tokens follow it, so attention always sees the newest
            ``raw_window`` to ``raw_window + r - 1`` tokens exactly (KIVI's residual window; unlike
            transformers' ``residual_length`` it slides, it is never flushed).
        window_bits: how the window (and the incomplete block) is stored: None (the default) in
            the input dtype, bit for bit; 8 in int8 per token with an fp32 scale and zero point
            (:class:`~flashcodec.codecs.tail.Uint8Tail`), a little over half the bytes.

    ``D`` must be even (two codes a byte). Arithmetic in fp32; :meth:`decode` returns the
    requested dtype.
    """

    mode: ClassVar[str] = "jpeg-int4z"
    int4_zero_nibble: ClassVar[bool] = True

    block_size: int = 8
    keep_freqs: int | None = None
    raw_window: int = 0
    window_bits: int | None = None

    def __post_init__(self) -> None:
        r = check_block_size(self.block_size)
        set_window_fields(self)
        k = r if self.keep_freqs is None else self.keep_freqs
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= r:
            raise KVConfigError(
                f"keep_freqs must be an integer in 1..block_size={r}; got {self.keep_freqs!r}"
            )
        object.__setattr__(self, "block_size", r)
        object.__setattr__(self, "keep_freqs", int(k))

    @property
    def _dct(self) -> JPEGCodec:
        return JPEGCodec(self.block_size, self.keep_freqs)

    @property
    def rows(self) -> int:
        return self.keep_freqs

    @property
    def lossless(self) -> bool:
        return False

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        return row_affine_specs(
            PartSpec("coeffs", (self.keep_freqs, packed_width(dim)), torch.uint8), self.keep_freqs
        )

    def check_dim(self, dim: int) -> None:
        check_even(self.mode, dim)

    def analysis_matrix(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """``M [K, r]`` (encode: ``C = M @ block``)."""
        return self._dct.analysis_matrix(dtype, device)

    def synthesis_matrix(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """``A = M^T [r, K]`` (decode: ``block = A @ rows``)."""
        return self._dct.synthesis_matrix(dtype, device)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., n*r, D]`` -> ``(uint8 coeffs [..., n, K, D/2], fp16 scales, fp16 zeros [..., n, K, 1])``."""
        blocks = to_blocks(x, self.block_size)
        cdt = compute_dtype(x.dtype)
        coeffs = torch.matmul(self.analysis_matrix(cdt, x.device), blocks.to(cdt))
        return quantize_int4_zero(coeffs)

    def _dequantize(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """Coefficients ``[..., n, K, D]`` in ``dtype`` (codes times scale plus zero)."""
        q, scale, zero = parts
        return dequantize_int4_zero(q, scale, zero, 2 * q.shape[-1], dtype)

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """Parts for ``n`` blocks -> ``[..., n*r, D]`` in ``dtype`` (one batched GEMM in fp32)."""
        cdt = compute_dtype(dtype)
        coeffs = self.stored_rows(parts, cdt)
        blocks = torch.matmul(self.synthesis_matrix(cdt, coeffs.device), coeffs)
        return to_output(from_blocks(blocks), dtype)
