"""Symmetric int8 codes with one scale per row: the int8 recent window's rows
(:class:`~palu_mlx.sinks.RecentWindow`) and the 8-bit basis's columns
(:class:`~palu_mlx.lowrank.PackedProjection`)."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["int8_rows", "int8_values"]


def int8_rows(x: mx.array, scale_dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
    """Rows ``[..., D]`` -> symmetric int8 codes ``[..., D]`` and one scale per row ``[..., 1]`` in
    ``scale_dtype`` (default ``x``'s dtype). The codes are made against the stored (rounded) scale,
    so decoding sees the same numbers."""
    x32 = x.astype(mx.float32)
    dtype = x.dtype if scale_dtype is None else scale_dtype
    scale = (mx.maximum(mx.max(mx.abs(x32), axis=-1, keepdims=True), 1e-30) / 127.0).astype(dtype)
    codes = mx.clip(mx.round(x32 / scale.astype(mx.float32)), -127, 127).astype(mx.int8)
    return codes, scale


def int8_values(codes: mx.array, scale: mx.array) -> mx.array:
    """Inverse of :func:`int8_rows`, in the scale's dtype."""
    return (codes.astype(mx.float32) * scale.astype(mx.float32)).astype(scale.dtype)
