"""The palu-mlx tab: mlx-lm models, palu's tiers and mlx-lm's QuantizedKVCache peers.

On Linux the model computes in float32 by default, its keys and values rounded to the cache dtype
(bfloat16) before they are cached (``palu-mlx compare --compute-dtype float32``): MLX's Linux CPU
build multiplies bfloat16 matrices without a BLAS, several times slower than float32 through
OpenBLAS (loaded by :mod:`demo.blas`), which made a chat turn of the real model too slow to wait
for. The caches still receive and store what a bfloat16 model caches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .blas import loaded_blas, use_openblas

use_openblas()  # before MLX is imported: see demo.blas

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from kvbench.cli import Loaded  # noqa: E402
from palu_mlx.compare import PaluHarness  # noqa: E402

from .backend import Backend  # noqa: E402

__all__ = ["PaluBackend", "default_compute_dtype", "fix_rope_theta"]

COMPUTE_DTYPES = ("auto", "same", "float32")


def default_compute_dtype() -> str:
    """What ``auto`` means: float32 on Linux (see the module docstring), the model's dtype elsewhere."""
    return "float32" if sys.platform == "linux" else "same"


class PaluBackend(Backend):
    key = "palu"
    title = "palu-mlx (mlx-lm)"
    # the registry's tier with the lowest KL on the real model (a fixed rotation, 4-bit codes)
    closest_choice = "rotation-4bit"
    # the tier KVCacheConfig()'s defaults are (no file; relative-error weighing, per-token scales,
    # exact first and newest tokens)
    default_choice = "palu-2.25bit-scaled+rel"

    def __init__(self, dtype: str = "bfloat16", compute_dtype: str = "auto"):
        super().__init__(PaluHarness(), dtype)
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}; got {compute_dtype!r}"
            )
        self.compute_dtype = default_compute_dtype() if compute_dtype == "auto" else compute_dtype
        # the harness's own option defaults (its --calibration, and --compute-dtype where it has it)
        parser = argparse.ArgumentParser(add_help=False)
        self.harness.add_arguments(parser)
        self._defaults = vars(parser.parse_args([]))

    def model_args(self, model: str) -> argparse.Namespace:
        args = {**self._defaults, "model": model, "dtype": self.dtype}
        if self.compute_dtype == "float32" and self.dtype != "float32":
            if "compute_dtype" in self._defaults:
                args["compute_dtype"] = "float32"
            else:  # a harness without --compute-dtype: the whole model (and its caches) in float32
                args["dtype"] = "float32"
        return argparse.Namespace(**args)

    def prepare(self, loaded: Loaded) -> Loaded:
        theta = fix_rope_theta(loaded.handle, loaded.info.get("source"))
        if theta is not None:
            loaded.info["rope_theta"] = theta
        return loaded

    def precision_note(self, loaded: Loaded | None = None) -> str:
        info = loaded.info if loaded is not None else {}
        compute = info.get("compute_dtype") or (
            self.dtype if self.compute_dtype == "same" else self.compute_dtype
        )
        cached = info.get("kv_dtype") or info.get("dtype") or self.dtype
        if compute == cached:
            return f"model and caches in {cached}"
        blas = loaded_blas()
        through = f", matrix products through {Path(blas).name} ({Path(blas).parent.name})" if blas else ""
        return (
            f"model computes in {compute}{through}; keys and values rounded to {cached} before they "
            f"are cached (MLX's Linux CPU build is several times slower in {cached})"
        )

    def memory_now(self, loaded: Loaded) -> int | None:
        # the MLX allocator's live bytes: what the runner's peak is measured against
        return mx.get_active_memory()


def fix_rope_theta(model: Any, source: str | None) -> float | None:
    """Give every layer's RoPE the base the model's ``config.json`` names; returns it when a layer
    had another, else None.

    transformers 5 writes the base only nested, as ``rope_parameters.rope_theta``; mlx-lm's
    llama reads the top-level ``rope_theta`` alone and otherwise rotates with its default 10000.
    SmolLM2 (base 100000), converted with transformers 5, then answers with wrong positions (its
    log-probabilities off by up to 4.5 nats against transformers'); with the base put back, MLX
    in float32 gives transformers' float32 log-probabilities. Only a plain rotation (``rope_type``
    default) is changed: the others carry more than a base.
    """
    if not source or not (Path(source) / "config.json").is_file():
        return None
    try:
        config = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    params = config.get("rope_parameters")
    if "rope_theta" in config or not isinstance(params, dict):
        return None  # mlx-lm read the base itself
    theta = params.get("rope_theta")
    if theta is None or params.get("rope_type", "default") != "default":
        return None
    changed = False
    for layer in getattr(model, "layers", []):
        rope = getattr(getattr(layer, "self_attn", None), "rope", None)
        if type(rope) is nn.RoPE and rope.base != theta:
            rope.base = float(theta)
            changed = True
    if changed and getattr(model, "args", None) is not None and hasattr(model.args, "rope_theta"):
        model.args.rope_theta = float(theta)
    return float(theta) if changed else None
