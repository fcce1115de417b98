"""Mixed-bit JPEG: block DCT-II along the sequence axis with bits chosen per frequency.

A transform coder's gain over plain quantization comes from *bit allocation*: an orthonormal
transform followed by the same quantizer on every coefficient has the same error as quantizing the
tokens themselves (measured on the embedded model's K/V: jpeg-k8-int4 and per-token int4 hold the
same bytes and give the same relative error). What the DCT buys is that frequencies differ in
variance, so bits can move from the quiet ones to the loud ones. :class:`MixedJPEGCodec` stores
frequency ``j`` with ``freq_bits[j]`` bits: 8 (int8), 4 (packed int4) or 0 (dropped), each row with
one fp32 scale per (block, frequency). :func:`allocate_freq_bits` chooses ``freq_bits`` from
measured coefficient variances (:func:`frequency_variances`) by greedy reverse water-filling.

Stored parts per block (``K8`` / ``K4``: frequencies at 8 / 4 bits, ``R = K8 + K4``):
  * ``coeffs8 [K8, D]`` int8 (only when ``K8 > 0``), ``coeffs4 [K4, D/2]`` uint8 (only when
    ``K4 > 0``), ``scales [R, 1]`` fp32; rows ordered: the 8-bit frequencies ascending, then the
    4-bit ones. ``A [r, R]`` is the matching columns of ``M^T``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch
from kvspec import KVConfigError, KVShapeError

from .base import BlockCodec, PartSpec, check_block_size, compute_dtype, from_blocks, to_blocks, to_output
from .jpeg import JPEGCodec
from .quant import QMAX, QMAX4, _pack_int4, packed_width, unpack_int4

__all__ = ["MixedJPEGCodec", "FREQ_BITS", "allocate_freq_bits", "frequency_variances"]

#: bits a frequency may get
FREQ_BITS = (0, 4, 8)


@dataclass(frozen=True)
class MixedJPEGCodec(BlockCodec):
    """Block DCT-II codec with per-frequency bits (8, 4 or 0).

    Args:
        block_size: ``r``, tokens per block.
        freq_bits: one entry per frequency (``r`` entries) in ``(0, 4, 8)``, at least one non-zero;
            ``None`` (default): 8 bits for the DC, 4 for every other frequency. Stored as a tuple.

    dtypes: arithmetic in fp32; codes int8 / packed int4 with fp32 scales; ``D`` must be even
    when a frequency has 4 bits.
    """

    mode: ClassVar[str] = "jpeg-mixed"

    block_size: int = 8
    freq_bits: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        r = check_block_size(self.block_size)
        bits = (8,) + (4,) * (r - 1) if self.freq_bits is None else self.freq_bits
        try:
            bits = tuple(bits)
        except TypeError:
            bits = None
        if (
            bits is None
            or len(bits) != r
            or any(
                isinstance(b, bool) or not isinstance(b, numbers.Integral) or b not in FREQ_BITS for b in bits
            )
            or not any(bits)
        ):
            raise KVConfigError(
                f"freq_bits must be {r} values (one per frequency of block_size={r}) from {FREQ_BITS}, "
                f"not all 0; got {self.freq_bits!r}"
            )
        object.__setattr__(self, "block_size", r)
        object.__setattr__(self, "freq_bits", tuple(int(b) for b in bits))

    # ------------------------------------------------------------------ description
    @property
    def order(self) -> tuple[int, ...]:
        """The stored frequencies in row order: the 8-bit ones ascending, then the 4-bit ones."""
        bits = self.freq_bits or ()
        return tuple(j for j, b in enumerate(bits) if b == 8) + tuple(j for j, b in enumerate(bits) if b == 4)

    @property
    def k8(self) -> int:
        return sum(1 for b in self.freq_bits or () if b == 8)

    @property
    def k4(self) -> int:
        return sum(1 for b in self.freq_bits or () if b == 4)

    @property
    def rows(self) -> int:
        return self.k8 + self.k4

    @property
    def lossless(self) -> bool:
        return False

    def check_dim(self, dim: int) -> None:
        if self.k4 and dim % 2:
            raise KVShapeError(
                f"4-bit frequencies pack two codes a byte along D: D must be even; got D={dim}"
            )

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        specs = []
        if self.k8:
            specs.append(PartSpec("coeffs8", (self.k8, dim), torch.int8))
        if self.k4:
            specs.append(PartSpec("coeffs4", (self.k4, packed_width(dim)), torch.uint8))
        specs.append(PartSpec("scales", (self.rows, 1), torch.float32))
        return tuple(specs)

    def analysis_matrix(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """``M [R, r]``: the DCT rows of the stored frequencies, in row order."""
        full = JPEGCodec(self.block_size).analysis_matrix(dtype, device)
        return full[list(self.order)]

    def synthesis_matrix(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """``A = M^T [r, R]``."""
        return self.analysis_matrix(dtype, device).T

    # ------------------------------------------------------------------ maps
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., n*r, D]`` -> ``(coeffs8?, coeffs4?, scales [..., n, R, 1])`` (see the module docstring)."""
        blocks = to_blocks(x, self.block_size)
        cdt = compute_dtype(x.dtype)
        coeffs = torch.matmul(self.analysis_matrix(cdt, x.device), blocks.to(cdt)).to(torch.float32)
        qmax = torch.tensor([QMAX] * self.k8 + [QMAX4] * self.k4, dtype=torch.float32, device=x.device)
        scale = coeffs.abs().amax(dim=-1, keepdim=True) / qmax[:, None]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(coeffs / safe)
        parts = []
        if self.k8:
            parts.append(q[..., : self.k8, :].clamp(-QMAX, QMAX).to(torch.int8))
        if self.k4:
            parts.append(_pack_int4(q[..., self.k8 :, :].clamp(-QMAX4, QMAX4)))
        parts.append(scale)
        return tuple(parts)

    def _split(
        self, parts: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        parts = list(parts)
        c8 = parts.pop(0) if self.k8 else None
        c4 = parts.pop(0) if self.k4 else None
        return c8, c4, parts[0]

    def stored_rows(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """Dequantized coefficients ``[..., n, R, D]`` in ``dtype``, in row order."""
        self.check_parts(parts)
        c8, c4, scale = self._split(parts)
        rows = []
        if c8 is not None:
            rows.append(c8.to(torch.float32))
        if c4 is not None:
            rows.append(unpack_int4(c4, 2 * c4.shape[-1]).to(torch.float32))
        return (torch.cat(rows, dim=-2) * scale).to(dtype)

    def row_segments(
        self, parts: tuple[torch.Tensor, ...]
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """``((coeffs8?, coeffs4?), scales [..., n, R])``: the codes as stored (int8, packed uint8)."""
        self.check_parts(parts)
        c8, c4, scale = self._split(parts)
        return tuple(c for c in (c8, c4) if c is not None), scale[..., 0]

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        cdt = compute_dtype(dtype)
        coeffs = self.stored_rows(parts, cdt)
        blocks = torch.matmul(self.synthesis_matrix(cdt, coeffs.device), coeffs)
        return to_output(from_blocks(blocks), dtype)

    # ------------------------------------------------------------------ bit allocation
    @classmethod
    def from_variances(cls, variances: torch.Tensor | list[float], avg_bits: float) -> MixedJPEGCodec:
        """The codec :func:`allocate_freq_bits` chooses for ``variances`` (one per frequency)."""
        variances = torch.as_tensor(variances, dtype=torch.float64)
        return cls(len(variances), freq_bits=allocate_freq_bits(variances, avg_bits))


def frequency_variances(x: torch.Tensor, block_size: int = 8) -> torch.Tensor:
    """Mean square of each DCT frequency over every block of ``x [..., S, D]`` (``S`` cut to whole blocks).

    Returns fp64 ``[r]``: the variances :func:`allocate_freq_bits` takes (measured, e.g., on a
    calibration text's keys and values, concatenated along any leading axis).
    """
    r = check_block_size(block_size)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        got = f"shape {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise KVShapeError(f"x must be a floating-point tensor [..., S, D]; got {got}")
    s = (x.shape[-2] // r) * r
    if s == 0:
        raise KVShapeError(f"x needs at least block_size={r} tokens along dim -2; got shape {tuple(x.shape)}")
    (coeffs,) = JPEGCodec(r).encode(x[..., :s, :].to(torch.float32))
    return coeffs.double().pow(2).mean(dim=tuple(i for i in range(coeffs.dim()) if i != coeffs.dim() - 2))


def allocate_freq_bits(variances: torch.Tensor | list[float], avg_bits: float) -> tuple[int, ...]:
    """Bits per frequency from ``(0, 4, 8)`` with mean at most ``avg_bits``, by greedy reverse water-filling.

    Distortion model (high-rate): a frequency of variance ``v`` coded with ``b`` bits leaves
    ``v * 2**(-2b)``, uncoded (``b = 0``) leaves ``v``. Starting from 0 bits everywhere, each step
    gives 4 more bits to the frequency whose distortion drops most, while the budget allows.
    Ties go to the lower frequency. ``KVConfigError`` for a budget outside ``[4 / r, 8]`` or bad
    variances.
    """
    v = torch.as_tensor(variances, dtype=torch.float64).flatten()
    r = v.numel()
    if r == 0 or not torch.isfinite(v).all() or (v < 0).any():
        raise KVConfigError(f"variances must be finite, non-negative, one per frequency; got {variances!r}")
    if isinstance(avg_bits, bool) or not isinstance(avg_bits, numbers.Real) or not 4 / r <= avg_bits <= 8:
        raise KVConfigError(f"avg_bits must be a number in [4/r, 8] = [{4 / r:g}, 8]; got {avg_bits!r}")
    bits = [0] * r
    budget = int(avg_bits * r + 1e-9) // 4  # steps of 4 bits
    for _ in range(budget):
        gains = [
            float(v[j]) * (2.0 ** (-2 * bits[j])) * (1 - 2.0**-8) if bits[j] < 8 else -1.0 for j in range(r)
        ]
        best = max(range(r), key=lambda j: (gains[j], -j))
        if gains[best] < 0:
            break
        bits[best] += 4
    return tuple(bits)
