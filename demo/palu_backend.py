"""The palu-mlx tab: mlx-lm models, palu's tiers and mlx-lm's QuantizedKVCache peers."""

from __future__ import annotations

import argparse

import mlx.core as mx
from kvbench.cli import Loaded
from palu_mlx.compare import PaluHarness

from .backend import Backend

__all__ = ["PaluBackend"]


class PaluBackend(Backend):
    key = "palu"
    title = "palu-mlx (mlx-lm)"
    lossless = "full-rank-fp16"
    default_choice = "palu-3bit"

    def __init__(self, dtype: str = "bfloat16"):
        super().__init__(PaluHarness(), dtype)

    def model_args(self, model: str | None) -> argparse.Namespace:
        return argparse.Namespace(model=model, dtype=self.dtype, calibration=None)

    def memory_now(self, loaded: Loaded) -> int | None:
        # the MLX allocator's live bytes: what the runner's peak is measured against
        return mx.get_active_memory()
