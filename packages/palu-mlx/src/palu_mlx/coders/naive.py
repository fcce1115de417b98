"""The naive baseline as a coder choice: uniform group quantization of the full K/V."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NaiveQuant"]


@dataclass(frozen=True)
class NaiveQuant:
    """``mx.quantize`` of every K/V row at ``bits`` with groups of ``group_size`` channels
    (:mod:`palu_mlx.baseline`); checked by the config."""

    bits: int = 2
    group_size: int = 64
