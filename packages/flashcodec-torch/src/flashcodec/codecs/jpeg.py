"""JPEG mode: orthonormal block DCT-II along the sequence axis, keep the lowest K frequencies.

For a block ``X [r, D]`` of ``r`` consecutive tokens, the coefficients are ``C = M X`` with
``M [K, r]``, ``M[j, n] = c_j cos(pi / r * (n + 1/2) * j)``, ``c_0 = sqrt(1/r)``,
``c_j = sqrt(2/r)``. The full ``r x r`` matrix is orthonormal, so ``K = r`` is lossless up to
float rounding and ``X_hat = M^T C``. Encode and decode are one broadcast batched GEMM over
every block of every (batch, head): no Python loop over blocks.

Stored parts per block (``PartSpec``):
  * ``quant_bits=None``: ``coeffs [K, D]`` in the input dtype.
  * ``quant_bits=8``: ``coeffs [K, D]`` int8 and ``scales [K, 1]`` fp32
    (one scale per (block, frequency), counted in storage).
  * ``quant_bits=4``: ``coeffs [K, ceil(D/2)]`` uint8 (two int4 codes a byte, see
    :mod:`flashcodec.codecs.quant`) and ``scales [K, 1]`` fp32.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch
from kvspec import KVConfigError, KVShapeError

from ..validate import check_int
from .base import BlockCodec, PartSpec, check_block_size, compute_dtype, from_blocks, to_blocks, to_output
from .quant import dequantize_int4, dequantize_int8, packed_width, quantize_int4, quantize_int8

__all__ = ["JPEGCodec", "dct_matrix"]


@lru_cache(maxsize=64)
def _dct_matrix_f64(block_size: int, keep_freqs: int) -> torch.Tensor:
    n = torch.arange(block_size, dtype=torch.float64)
    j = torch.arange(keep_freqs, dtype=torch.float64).unsqueeze(1)
    m = torch.cos(math.pi / block_size * (n + 0.5) * j) * math.sqrt(2.0 / block_size)
    m[0] = m[0] / math.sqrt(2.0)
    return m


def dct_matrix(
    block_size: int,
    keep_freqs: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The DCT-II analysis matrix ``M [K, r]`` (lowest ``K`` rows of the orthonormal ``r x r`` one).

    Built in float64 and cast, so every dtype gets correctly rounded entries. ``keep_freqs``: ``K``
    in ``1..block_size`` (None: ``block_size``); ``dtype``: a floating dtype.
    """
    r = check_block_size(block_size)
    k = r if keep_freqs is None else check_int("keep_freqs", keep_freqs, low=1, high=r)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise KVConfigError(f"dtype must be a floating torch.dtype; got {dtype!r}")
    return _dct_matrix_f64(r, k).to(dtype=dtype, device=device)


@lru_cache(maxsize=256)
def _cached_matrix(block_size: int, keep_freqs: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return dct_matrix(block_size, keep_freqs, dtype=dtype, device=device)


@dataclass(frozen=True)
class JPEGCodec(BlockCodec):
    """Block DCT-II codec: ``r`` tokens -> ``K`` coefficient rows (optionally int8).

    Args:
        block_size: ``r``, tokens per block (>= 1).
        keep_freqs: ``K`` in ``1..r``; ``None`` (the default) means ``r``: lossless up to float
            rounding. Stored as the resolved ``K``, so ``JPEGCodec(8) == JPEGCodec(8, 8)``.
        quant_bits: ``None`` (coefficients in the input dtype), ``8`` (int8 + fp32 scales) or
            ``4`` (int4, two codes a byte, + fp32 scales); one scale per (block, frequency).

    dtypes: arithmetic runs in fp32 (fp64 for fp64 input); non-quantized coefficients are
    stored in the input dtype and :meth:`decode` returns the requested dtype.
    """

    mode: ClassVar[str] = "jpeg"

    block_size: int = 8
    keep_freqs: int | None = None
    quant_bits: int | None = None

    def __post_init__(self) -> None:
        block_size = check_block_size(self.block_size)
        keep_freqs = block_size if self.keep_freqs is None else self.keep_freqs
        if (
            isinstance(keep_freqs, bool)
            or not isinstance(keep_freqs, numbers.Integral)
            or not 1 <= keep_freqs <= block_size
        ):
            raise KVConfigError(
                f"keep_freqs must be an integer in 1..block_size={block_size}; got {self.keep_freqs!r}"
            )
        quant_bits = self.quant_bits
        if quant_bits is not None and (
            isinstance(quant_bits, bool)
            or not isinstance(quant_bits, numbers.Integral)
            or quant_bits not in (4, 8)
        ):
            raise KVConfigError(f"quant_bits must be None, 8 or 4; got {quant_bits!r}")
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "keep_freqs", int(keep_freqs))
        object.__setattr__(self, "quant_bits", None if quant_bits is None else int(quant_bits))

    # ------------------------------------------------------------------ description
    @property
    def rows(self) -> int:
        return self.keep_freqs

    @property
    def lossless(self) -> bool:
        """True for ``K = r`` without int8: exact up to float rounding (not bitwise)."""
        return self.keep_freqs == self.block_size and self.quant_bits is None

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        if self.quant_bits == 8:
            return (
                PartSpec("coeffs", (self.keep_freqs, dim), torch.int8),
                PartSpec("scales", (self.keep_freqs, 1), torch.float32),
            )
        if self.quant_bits == 4:
            return (
                PartSpec("coeffs", (self.keep_freqs, packed_width(dim)), torch.uint8),
                PartSpec("scales", (self.keep_freqs, 1), torch.float32),
            )
        return (PartSpec("coeffs", (self.keep_freqs, dim), None),)

    def check_dim(self, dim: int) -> None:
        """int4 packs two codes a byte along ``D``: ``D`` must be even (every head size in use is)."""
        if self.quant_bits == 4 and dim % 2:
            raise KVShapeError(f"quant_bits=4 packs two codes a byte along D: D must be even; got D={dim}")

    def analysis_matrix(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """``M [K, r]`` (encode: ``C = M @ block``)."""
        return _cached_matrix(self.block_size, self.keep_freqs, dtype, str(torch.device(device or "cpu")))

    def synthesis_matrix(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """``A = M^T [r, K]`` (decode: ``block = A @ coeffs``)."""
        return self.analysis_matrix(dtype, device).T

    # ------------------------------------------------------------------ maps
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., n*r, D]`` -> ``(coeffs [..., n, K, D],)`` in ``x.dtype``,
        or ``(int8 coeffs [..., n, K, D], fp32 scales [..., n, K, 1])`` with ``quant_bits=8``,
        or ``(uint8 packed coeffs [..., n, K, ceil(D/2)], fp32 scales [..., n, K, 1])`` with ``quant_bits=4``.
        """
        blocks = to_blocks(x, self.block_size)
        cdt = compute_dtype(x.dtype)
        coeffs = torch.matmul(self.analysis_matrix(cdt, x.device), blocks.to(cdt))
        if self.quant_bits == 8:
            return quantize_int8(coeffs, dim=-1)
        if self.quant_bits == 4:
            return quantize_int4(coeffs)
        return (coeffs.to(x.dtype),)

    def stored_rows(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """Coefficients ``[..., n, K, D]`` in ``dtype`` (int8 / int4 dequantized with their scales).

        int4: ``D`` is twice the packed width (:meth:`check_dim` refuses an odd ``D``).
        """
        self.check_parts(parts)
        if self.quant_bits == 8:
            q, scale = parts
            return dequantize_int8(q, scale, dtype)
        if self.quant_bits == 4:
            q, scale = parts
            return dequantize_int4(q, scale, 2 * q.shape[-1], dtype)
        (coeffs,) = parts
        return coeffs.to(dtype)

    def row_segments(
        self, parts: tuple[torch.Tensor, ...]
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """``((coeffs [..., n, K, D or ceil(D/2)],), scales [..., n, K] or None)``: the parts as
        stored (int8 stays int8; int4 stays packed uint8, which the kernels recognize by dtype)."""
        self.check_parts(parts)
        if self.quant_bits is not None:
            q, scale = parts
            return (q,), scale[..., 0]
        return (parts[0],), None

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """Parts for ``n`` blocks -> ``[..., n*r, D]`` in ``dtype`` (one batched GEMM in fp32)."""
        cdt = compute_dtype(dtype)
        coeffs = self.stored_rows(parts, cdt)
        blocks = torch.matmul(self.synthesis_matrix(cdt, coeffs.device), coeffs)
        return to_output(from_blocks(blocks), dtype)
