"""Block codecs along the sequence axis: pure tensor maps, no cache state.

``make_codec(mode=...)`` builds one from the same keywords ``CodecKVCache`` takes.
"""

from __future__ import annotations

import torch
from kvspec import KVConfigError

from .base import BlockCodec, PartSpec
from .jpeg import JPEGCodec, dct_matrix
from .png import PNGCodec, delta_variance_ratio
from .quant import dequantize_int8, quantize_int8

__all__ = [
    "BlockCodec",
    "PartSpec",
    "JPEGCodec",
    "PNGCodec",
    "make_codec",
    "dct_matrix",
    "delta_variance_ratio",
    "quantize_int8",
    "dequantize_int8",
]

MODES = ("jpeg", "png")


def make_codec(
    mode: str = "jpeg",
    block_size: int = 8,
    keep_freqs: int | None = None,
    keep_ratio: float = 1.0,
    quant_bits: int | None = None,
    delta_dtype: torch.dtype | str | None = None,
) -> BlockCodec:
    """Build a codec from cache-style keywords.

    ``mode="jpeg"`` takes ``keep_freqs`` (``1..r``, default ``r``) and ``quant_bits`` (None or 8);
    ``mode="png"`` takes ``keep_ratio`` (``(0, 1]``) and ``delta_dtype`` (float64 default, or float32).
    An option of the other mode raises ``KVConfigError`` instead of being silently ignored.
    """
    if mode not in MODES:
        raise KVConfigError(f"mode must be one of {MODES}; got {mode!r}")
    if mode == "jpeg":
        if keep_ratio != 1.0:
            raise KVConfigError(
                f"keep_ratio applies to mode='png' only; got keep_ratio={keep_ratio!r} with mode='jpeg'"
            )
        if delta_dtype is not None:
            raise KVConfigError(f"delta_dtype applies to mode='png' only; got delta_dtype={delta_dtype!r}")
        return JPEGCodec(block_size=block_size, keep_freqs=keep_freqs, quant_bits=quant_bits)
    if quant_bits is not None:
        raise KVConfigError(
            f"quant_bits applies to mode='jpeg' only; got quant_bits={quant_bits!r} with mode='png'"
        )
    if keep_freqs is not None:
        raise KVConfigError(
            f"keep_freqs applies to mode='jpeg' only; got keep_freqs={keep_freqs!r} with mode='png'"
        )
    return PNGCodec(block_size=block_size, keep_ratio=keep_ratio, delta_dtype=delta_dtype)
