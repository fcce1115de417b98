"""Symmetric int8 quantization with one fp32 scale per row (pure tensor maps).

Used by the jpeg codec with ``quant_bits=8``: one scale per (block, frequency), i.e. the
reduction runs over the head dimension ``D`` (``dim=-1``). Scales are kept in fp32 whatever
the input dtype: an fp16 scale of a small coefficient row could underflow, and the scales
are a small share of the bytes (4 bytes per ``D`` int8 values).
"""

from __future__ import annotations

import torch

__all__ = ["QMAX", "quantize_int8", "dequantize_int8"]

#: symmetric range: -127..127 (-128 unused, so negation never overflows)
QMAX = 127


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
