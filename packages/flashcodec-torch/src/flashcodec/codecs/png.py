"""PNG mode: per-block anchor (the block's first token, kept as is) plus first-order deltas.

For a block ``x_0 .. x_{r-1}`` the stored parts are the anchor ``x_0`` (input dtype) and the
deltas ``d_i = x_i - x_{i-1}`` (``i = 1..r-1``) in the *delta dtype*; decode rebuilds
``x_i = x_0 + d_1 + ... + d_i`` with one ``cumsum``, which is linear and autograd-differentiable.
Top-M pruning (``keep_ratio < 1``) zeroes the smallest-magnitude deltas of each block, keeping
``M = ceil(keep_ratio * (r-1) * D)`` of them; the dense layout keeps its size (the zeros are for
an entropy coder, none is bundled).

Why the default delta dtype is float64, not float32
---------------------------------------------------
A difference of two bf16 (or fp16) values is *not* always representable in float32: when the two
magnitudes differ by more than about 2^16 (bf16) or when a large fp16 value sits next to a tiny
one, ``fl32(x_i - x_{i-1})`` rounds away low bits of the small value and the rebuilt token is off
by an ulp or more. Measured on i.i.d. Gaussian [4, 8, 4096, 64] data with r=8: 49 of 8.4M bf16
elements and 240 of 8.4M fp16 elements came back different with fp32 deltas; 0 with fp64
deltas. So, with the default ``delta_dtype=torch.float64`` and ``keep_ratio=1.0``, decode
returns every element *exactly* (equal value; identical bits except for the sign of zero, below):

* fp16 input: always. Every fp16 value is a multiple of 2^-24 below 2^16, so any difference,
  and any partial sum of consecutive deltas (``x_b - x_a``, whatever order ``cumsum``
  associates in), fits in 41 bits < 53.
* bf16 input: whenever, inside each block, the non-zero magnitudes span less than 2^45
  (fp64 has 53 bits, bf16 significands 8); beyond that, within rounding.
* fp32 input: whenever, inside each block, the non-zero magnitudes span less than 2^29
  (53 - 24); beyond that, within fp32 rounding.

``delta_dtype=torch.float32`` halves the delta bytes and is lossless within rounding only.

Signed zeros: a delta cannot carry the sign of a zero (``a + (-a)`` is ``+0.0`` in IEEE
arithmetic), so ``-0.0`` comes back as ``+0.0``. "Bitwise" above therefore means every element
compares equal and every non-zero element keeps its exact bit pattern. :meth:`PNGCodec.canonical`
maps ``-0.0`` to ``+0.0`` (anchors included) so that the cache's raw tail agrees bit for bit with
what the archive later returns. The two zeros compare equal and give identical attention scores.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch
from kvspec import KVConfigError, KVShapeError

from .base import BlockCodec, PartSpec, check_block_size, from_blocks, to_blocks, to_output

__all__ = ["PNGCodec", "delta_variance_ratio", "DELTA_DTYPES"]

#: accepted delta dtypes, by name
DELTA_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _check_delta_dtype(delta_dtype: object) -> torch.dtype:
    if delta_dtype is None:
        return torch.float64
    if isinstance(delta_dtype, str) and delta_dtype in DELTA_DTYPES:
        return DELTA_DTYPES[delta_dtype]
    if isinstance(delta_dtype, torch.dtype) and delta_dtype in DELTA_DTYPES.values():
        return delta_dtype
    raise KVConfigError(
        f"delta_dtype must be torch.float64, torch.float32 (or their names) or None; got {delta_dtype!r}"
    )


@dataclass(frozen=True)
class PNGCodec(BlockCodec):
    """Anchor + first-order delta codec, optional Top-M delta pruning.

    Args:
        block_size: ``r``, tokens per block (>= 1).
        keep_ratio: share of each block's ``(r-1) * D`` deltas kept, in ``(0, 1]``
            (``1.0``: lossless, see the module docstring for the exact guarantee).
        delta_dtype: ``torch.float64`` (``None``, the default: the bitwise tier) or
            ``torch.float32``, or their names; stored as the ``torch.dtype``.

    Stored parts per block: ``anchors [D]`` in the input dtype and ``deltas [r-1, D]`` in the
    delta dtype. ``rows = [anchor, d_1, ..., d_{r-1}]`` and ``A`` is the ``r x r`` lower
    triangular matrix of ones, so ``block = A @ rows`` is exactly the cumsum.
    """

    mode: ClassVar[str] = "png"

    block_size: int = 8
    keep_ratio: float = 1.0
    delta_dtype: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        block_size = check_block_size(self.block_size)
        keep_ratio = self.keep_ratio
        if (
            isinstance(keep_ratio, bool)
            or not isinstance(keep_ratio, numbers.Real)
            or not math.isfinite(keep_ratio)
            or not 0.0 < keep_ratio <= 1.0
        ):
            raise KVConfigError(f"keep_ratio must be a number in (0, 1]; got {keep_ratio!r}")
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "keep_ratio", float(keep_ratio))
        object.__setattr__(self, "delta_dtype", _check_delta_dtype(self.delta_dtype))

    # ------------------------------------------------------------------ description
    @property
    def rows(self) -> int:
        return self.block_size

    @property
    def lossless(self) -> bool:
        return self.keep_ratio == 1.0

    def kept_per_block(self, dim: int) -> int:
        """``M = ceil(keep_ratio * (r-1) * dim)`` deltas kept per block."""
        total = (self.block_size - 1) * dim
        return min(total, math.ceil(self.keep_ratio * total))

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        return (
            PartSpec("anchors", (dim,), None),
            PartSpec("deltas", (self.block_size - 1, dim), self.delta_dtype),
        )

    def synthesis_matrix(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """``A [r, r]`` lower-triangular ones: ``block = A @ [anchor; deltas]``."""
        return torch.ones(self.block_size, self.block_size, dtype=dtype, device=device).tril()

    # ------------------------------------------------------------------ maps
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., n*r, D]`` -> ``(anchors [..., n, D] in x.dtype, deltas [..., n, r-1, D] in delta dtype)``.

        Differentiable in ``x`` (pruning multiplies by a 0/1 mask).
        """
        blocks = to_blocks(x, self.block_size)
        anchors = self.canonical(blocks[..., 0, :]).contiguous()
        deltas = torch.diff(blocks.to(self.delta_dtype), dim=-2)
        if self.keep_ratio < 1.0 and deltas.shape[-2] > 0:
            deltas = self._prune(deltas)
        return anchors, deltas

    def canonical(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with ``-0.0`` turned into ``+0.0`` (``x + 0`` is exact for every other value)."""
        return x + 0.0

    def _prune(self, deltas: torch.Tensor) -> torch.Tensor:
        """Keep the ``M`` largest-magnitude deltas of each block, zero the rest."""
        flat = deltas.flatten(-2)
        keep = self.kept_per_block(deltas.shape[-1])
        if keep >= flat.shape[-1]:
            return deltas
        idx = flat.abs().topk(keep, dim=-1, sorted=False).indices
        mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, True)
        return (flat * mask).reshape(deltas.shape)

    def stored_rows(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """``[anchor; deltas]`` as ``[..., n, r, D]`` in ``dtype`` (a copy)."""
        anchors, deltas = self._checked(parts)
        return torch.cat([anchors.unsqueeze(-2).to(dtype), deltas.to(dtype)], dim=-2)

    def row_segments(
        self, parts: tuple[torch.Tensor, ...]
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """``((anchors [..., n, 1, D], deltas [..., n, r-1, D]), None)``: views of the parts, no copy."""
        anchors, deltas = self._checked(parts)
        return (anchors.unsqueeze(-2), deltas), None

    def _checked(self, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(anchors [..., n, D], deltas [..., n, r-1, D])``; ``KVShapeError`` otherwise: a block
        with fewer delta rows would decode to a shorter block without a word."""
        self.check_parts(parts)
        anchors, deltas = parts
        if anchors.dim() < 1 or tuple(deltas.shape) != (
            *anchors.shape[:-1],
            self.block_size - 1,
            anchors.shape[-1],
        ):
            raise KVShapeError(
                f"png codec parts must be anchors [..., n, D] and deltas [..., n, r-1, D] with "
                f"r-1={self.block_size - 1} (block_size={self.block_size}); got anchors {tuple(anchors.shape)}, "
                f"deltas {tuple(deltas.shape)}"
            )
        return anchors, deltas

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """Parts for ``n`` blocks -> ``[..., n*r, D]`` in ``dtype``: ``cumsum`` in the delta dtype, then cast."""
        rows = self.stored_rows(parts, self.delta_dtype)
        return to_output(from_blocks(torch.cumsum(rows, dim=-2)), dtype)


def delta_variance_ratio(x: torch.Tensor) -> float:
    """``Var(x_i - x_{i-1}) / Var(x)`` along the sequence axis (``dim=-2``) of ``x [..., S, D]``.

    For a stationary sequence with lag-1 correlation ``rho`` this is ``2 (1 - rho)``: below 1 the
    deltas are smaller than the values (``rho > 1/2``), 2 means uncorrelated neighbours, and only
    above 2 are they anti-correlated (between 1 and 2 they are positively correlated, but too weakly
    for deltas to shrink). Both variances run over every element, so a constant per-channel offset
    counts as variance of ``x`` and lowers the ratio.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2 or x.shape[-2] < 2:
        got = f"shape {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise KVShapeError(f"x must be a floating-point tensor [..., S, D] with S >= 2; got {got}")
    xf = x.detach().to(torch.float64)
    return float(torch.diff(xf, dim=-2).var() / xf.var())
