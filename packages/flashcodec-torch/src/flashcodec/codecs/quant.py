"""int8 / int4 quantization with one scale per row (pure tensor maps): symmetric with an fp32
scale, or (int4 only) asymmetric with an fp16 scale and an fp16 zero point at the same bytes.

Used by the jpeg codec with ``quant_bits=8`` or ``4``: one scale per (block, frequency), i.e. the
reduction runs over the head dimension ``D`` (``dim=-1``). Scales are kept in fp32 whatever
the input dtype: an fp16 scale of a small coefficient row could underflow, and the scales
are a small share of the bytes (4 bytes per ``D`` codes).

int4 layout: codes ``q`` in ``-7..7`` stored as the nibble ``q + 8`` (``1..15``; ``0`` unused), two
per ``uint8`` byte along the last axis: element ``2i`` in the low nibble of byte ``i``, element
``2i + 1`` in its high nibble. An odd ``D`` is padded with one zero code. Every kernel that reads
packed rows recognizes them by their dtype (``torch.uint8``).

Asymmetric int4 (:func:`quantize_int4_zero`): ``x ~ scale * q + zero`` with ``q`` in ``-8..7``
(all 16 nibbles used), packed exactly as above, and ``scale`` and ``zero`` in fp16: 2 + 2 bytes
a row, the bytes of one fp32 scale. A row whose values are not centred on 0 (a key channel
offset in a DC row) then spends its 16 levels on its own range instead of ``[-max, max]``.
"""

from __future__ import annotations

import torch
from kvspec import KVValueError

__all__ = [
    "QMAX",
    "QMAX4",
    "quantize_int8",
    "dequantize_int8",
    "quantize_int4",
    "dequantize_int4",
    "pack_int4",
    "unpack_int4",
    "packed_width",
    "quantize_int4_zero",
    "dequantize_int4_zero",
]

#: symmetric range: -127..127 (-128 unused, so negation never overflows)
QMAX = 127
#: int4 symmetric range: -7..7
QMAX4 = 7


def quantize_int8(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to int8 with one scale per slice along ``dim``.

    Args:
        x: any float tensor, e.g. DCT coefficients ``[..., n, K, D]``.
        dim: the axis each scale covers (default ``-1``: one scale per row of ``D`` values).

    Returns:
        ``(q, scale)``: ``q`` int8 of ``x``'s shape, ``scale`` fp32 with ``dim`` kept as size 1,
        such that ``q * scale`` approximates ``x`` with error at most ``scale / 2`` per element.
        An all-zero slice gets ``scale = 0`` and ``q = 0``.
    """
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=dim, keepdim=True) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype``; ``q`` int8 ``[..., D]``, ``scale`` fp32 broadcastable to it."""
    return (q.to(torch.float32) * scale).to(dtype)


def packed_width(dim: int) -> int:
    """Bytes of ``dim`` int4 codes: ``ceil(dim / 2)``."""
    return (dim + 1) // 2


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes ``q`` (integers in ``-8..7``, ``[..., D]``) -> ``uint8 [..., ceil(D/2)]`` (layout above).

    ``KVValueError`` for a code outside ``-8..7``, NaN or not a whole number: it would spill into
    the neighbouring nibble. (The codecs pack codes they have just clamped, without this check.)
    """
    if q.numel():
        bad = ~torch.isfinite(q).all() if q.is_floating_point() else torch.tensor(False)
        if not bad:
            lo, hi = torch.aminmax(q.detach())
            whole = not q.is_floating_point() or bool(torch.equal(q, torch.round(q)))
            bad = int(lo) < -8 or int(hi) > 7 or not whole
        if bad:
            raise KVValueError("int4 codes must be whole numbers in -8..7; got values outside that")
    return _pack_int4(q)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    nib = (q.to(torch.int16) + 8).to(torch.uint8)
    if nib.shape[-1] % 2:
        nib = torch.cat([nib, torch.full_like(nib[..., :1], 8)], dim=-1)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """``uint8 [..., ceil(D/2)]`` -> int8 codes ``[..., D]`` in ``-8..7`` (``dim = D``)."""
    low = (packed & 15).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).flatten(-2)[..., :dim]


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` to packed int4 with one fp32 scale per row (over ``D``).

    Returns ``(packed, scale)``: ``packed`` uint8 ``[..., ceil(D/2)]``, ``scale`` fp32 ``[..., 1]``
    with ``unpack * scale`` within ``scale / 2`` of ``x``; an all-zero row gets ``scale = 0``.
    """
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1, keepdim=True) / QMAX4
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe).clamp_(-QMAX4, QMAX4)
    return _pack_int4(q), scale  # clamped just above


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``unpack_int4(packed, dim) * scale`` in ``dtype``; ``scale`` fp32 broadcastable to ``[..., dim]``."""
    return (unpack_int4(packed, dim).to(torch.float32) * scale).to(dtype)


#: largest finite fp16: scales and zero points are stored in fp16 and saturate here
_FP16_MAX = float(torch.finfo(torch.float16).max)


def quantize_int4_zero(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` to packed int4 with an fp16 scale and an fp16 zero point per row
    (``dim=-1``) or per column (``dim=-2``: one pair per element of the last axis, shared along ``dim``).

    Returns ``(packed, scale, zero)``: ``packed`` uint8 ``[..., ceil(D/2)]`` (codes ``q`` in
    ``-8..7``, layout above, always packed along the last axis), ``scale`` and ``zero`` fp16 with
    ``x``'s shape and ``dim`` reduced to 1 (``[..., 1]`` per row) with ``q * scale + zero``
    within ``scale / 2`` of ``x`` (computed from the stored fp16 values, so the bound holds for
    what is decoded). The zero point is rounded to fp16 first and the scale is then chosen to
    cover ``[min, max]`` around that rounded zero, rounded up. Rows with magnitudes beyond fp16's
    range (65504) saturate there; no K/V activation of a real model comes near it.
    """
    xf = x.to(torch.float32)
    lo, hi = torch.aminmax(xf, dim=dim, keepdim=True)
    # the zero sits at code 0: lo is code -8 and hi code 7, 15 steps apart
    zero = (lo + 8.0 * (hi - lo) / 15.0).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).float()
    need = torch.maximum((zero - lo) / 8.0, (hi - zero) / 7.0).clamp(0.0, _FP16_MAX / 2)
    # round up to fp16: a scale rounded down could push an end of the row past code -8 or 7
    scale = (need * (1.0 + 2.0**-10)).to(torch.float16)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(need))
    q = torch.round((xf - zero) / safe).clamp_(-8, 7)
    return _pack_int4(q), scale, zero.to(torch.float16)


def dequantize_int4_zero(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``unpack_int4(packed, dim) * scale + zero`` in fp32, cast to ``dtype``; ``scale`` and
    ``zero`` (fp16, ``[..., 1]`` per row or ``[..., 1, D]`` per column) broadcast over the codes."""
    codes = unpack_int4(packed, dim).to(torch.float32)
    return (codes * scale.float() + zero.float()).to(dtype)
