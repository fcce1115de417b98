"""What palu reads from an mlx-lm model: that it is one, its KV head dims, its default caches.

Both :mod:`palu_mlx.builder` (building caches for a model) and :mod:`palu_mlx.calibration`
(recording a model's keys and values) need these; they live here so that neither imports the
other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.nn as nn
from kvspec import KVConfigError
from mlx_lm.models import cache as mlx_cache

__all__ = ["check_model", "model_kv_dims", "original_make_cache", "default_caches"]


def check_model(model: Any) -> None:
    """KVConfigError unless ``model`` looks like an mlx-lm model: an ``mlx.nn.Module`` with a list
    of ``layers`` or its own ``make_cache`` (what building its caches reads)."""
    if not isinstance(model, nn.Module):
        raise KVConfigError(f"model must be an mlx-lm model (an mlx.nn.Module); got {type(model).__name__}")
    layers = getattr(model, "layers", None)
    if not callable(getattr(model, "make_cache", None)) and not isinstance(layers, (list, tuple)):
        raise KVConfigError(
            f"model ({type(model).__name__}) has neither a list of .layers nor a make_cache(); "
            "allowed: an mlx-lm model as mlx_lm.load returns it"
        )


def model_kv_dims(model: nn.Module) -> tuple[int | None, int | None]:
    """``(head_dim, n_kv_heads)`` of an mlx-lm model (None where unknown).

    ``n_kv_heads`` is the KV heads this process's attention computes: the attention modules'
    ``n_kv_heads`` where they have one, so a tensor-parallel shard (``mlx_lm.utils.sharded_load``,
    which divides it by the group size) gets its own share; else ``args.num_key_value_heads``.
    """
    check_model(model)
    args = getattr(model, "args", None)
    n_heads = getattr(args, "num_attention_heads", None)
    head_dim = getattr(args, "head_dim", None)
    if head_dim is None and n_heads and getattr(args, "hidden_size", None):
        head_dim = args.hidden_size // n_heads
    n_kv = getattr(args, "num_key_value_heads", None) or n_heads
    for layer in getattr(model, "layers", None) or []:
        local = getattr(getattr(layer, "self_attn", None), "n_kv_heads", None)
        if isinstance(local, int) and not isinstance(local, bool) and local > 0:
            n_kv = local
            break
    return head_dim, n_kv


def original_make_cache(model: nn.Module) -> Callable[[], list[Any]] | None:
    """The model's own ``make_cache`` (None: it has none), also while palu's is installed."""
    current = getattr(model, "make_cache", None)
    # Re-installing must not wrap our own factory: keep the model's real default.
    return getattr(current, "_palu_original", current)


def default_caches(model: nn.Module) -> list[Any]:
    """The caches the model builds for itself (mlx-lm's ``KVCache`` per layer without a ``make_cache``)."""
    original = original_make_cache(model)
    if original is not None:
        return list(original())
    return [mlx_cache.KVCache() for _ in model.layers]
