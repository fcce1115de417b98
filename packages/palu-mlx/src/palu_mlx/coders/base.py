"""What a palu cache asks of a latent coder, and what fitting one returns.

Two layers of objects:

* a **coder choice** (:class:`~palu_mlx.coders.hilo.HiLoSplit`,
  :class:`~palu_mlx.coders.water_filling.WaterFilling`) is configuration: the object a
  :class:`~palu_mlx.config.KVCacheConfig` holds as ``config.coder_choice``. Its
  ``fit(keys, values, settings)`` (:class:`FitSettings`: what the config and the model decide)
  fits each tensor's projection on the tokens held at the fit and returns it with a coder;
* a **latent coder** (:class:`LatentCoder`: :class:`~palu_mlx.mixed_bit.MixedBitCoder`,
  :class:`~palu_mlx.coders.fixed.FixedQuantCoder`) turns one tensor's latents into the arrays a
  cache stores per token, and back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from ..lowrank import GroupProjection
from ..mixed_bit import Segment

__all__ = ["LatentCoder", "Fitted", "FitSettings", "compact_dtype", "projection_dtype"]


@runtime_checkable
class LatentCoder(Protocol):
    """One tensor's coder: latents ``[B, H, S, r]`` <-> named arrays ``[B, H, S, width]`` per token."""

    @property
    def rank(self) -> int:
        """Latent channels coded (``r``)."""
        ...

    @property
    def quantizes(self) -> bool:
        """Whether any channel is quantized (else the latents are stored as they are)."""
        ...

    @property
    def assigned_avg_bits(self) -> float:
        """Mean code bits per latent channel (side information not counted)."""
        ...

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The channels as runs of one width each (recorded in a cache's ``meta_state``)."""
        ...

    @property
    def fixed_widths(self) -> tuple[int, ...] | None:
        """One width per channel for fixed quantizers (recorded with their ``steps``); None otherwise."""
        ...

    def field_widths(self) -> dict[str, tuple[int, mx.Dtype]]:
        """Name -> (last-axis width, dtype) of every array a coded token row holds."""
        ...

    def encode_fields(self, latents: mx.array) -> dict[str, mx.array]:
        """Latents ``[..., r]`` -> ``{field: [..., width]}``."""
        ...

    def decode_fields(self, fields: dict[str, mx.array]) -> mx.array:
        """``{field: [..., width]}`` -> latents ``[..., r]`` float32."""
        ...

    def constants(self) -> dict[str, mx.array]:
        """Arrays held once per cache beside the per-token fields (e.g. quantizer steps)."""
        ...


#: one tensor's fit: its projection (cast to the dtype it is stored in) and its coder
Fitted = tuple[GroupProjection, LatentCoder]


@dataclass(frozen=True)
class FitSettings:
    """What a coder choice's ``fit`` is told besides the tokens (the config's and the model's part).

    Attributes:
        groups: head groups sharing a projection.
        rank: latent channels kept (a cap for policies that choose their own rank), or None.
        energy_threshold: the spectrum's energy the rank keeps when ``rank`` is None.
        group_size: channels sharing a scale and bias in a mixed-bit coder's rows.
        quantize_values: whether values are quantized (else kept as unquantized latents).
        dtype: the dtype of the keys and values coded.
        gather: under tensor parallel (:meth:`palu_mlx.distributed.HeadShard.gather`), this rank's
            per-head statistics -> every head's, so that widths and ranks are one process's; None
            in one process.
    """

    groups: int
    rank: int | None
    energy_threshold: float
    group_size: int
    quantize_values: bool
    dtype: mx.Dtype
    gather: Callable[[np.ndarray], np.ndarray] | None = None


def compact_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """16-bit dtype for scales, biases and the projections of quantized latents."""
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


def projection_dtype(coder: LatentCoder, dtype: mx.Dtype) -> mx.Dtype:
    """The dtype a projection is stored in beside ``coder``'s codes of ``dtype`` inputs.

    Quantized latents carry far more error than 16-bit projections add (2^-11 relative), so their
    projections are stored at 16 bits; unquantized latents keep the input dtype so that full rank
    stays near-lossless.
    """
    return compact_dtype(dtype) if coder.quantizes else dtype
