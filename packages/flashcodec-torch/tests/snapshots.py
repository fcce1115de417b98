"""Full, bitwise snapshots of a cache, a layer, a transformers cache or a model's patch points, so a
test can assert that a call which raised left the object *exactly* as it was (not just its length)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from flashcodec import CodecKVCache
from flashcodec.stream import CodecStream


def _bits(t: torch.Tensor) -> tuple:
    """A tensor as (shape, dtype, device, raw bytes): equal snapshots mean identical bits (NaN included)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return (
        tuple(t.shape),
        t.dtype,
        str(t.device),
        bytes(flat.view(torch.uint8).numpy()) if flat.numel() else b"",
    )


def _stream(s: CodecStream | None) -> Any:
    if s is None:
        return None
    view = None
    if s.has_view and s.view_blocks:
        view = _bits(s._view[:, :, : s.view_blocks * s.block_size])  # the decoded part it trusts
    return (
        s.codec,
        (s.batch, s.heads, s.dim, s.dtype, str(s.device)),
        (s.n_blocks, s.tail_len, s.capacity, s.view_blocks, s.has_view),
        tuple(_bits(a) for a in s.archive),
        _bits(s.tail()),
        view,
    )


def snapshot(obj: Any) -> Any:
    """Everything observable about ``obj`` (CodecKVCache, FlashCodecLayer, FlashCodecCache, a module)."""
    if obj is None:
        return None
    if isinstance(obj, CodecKVCache):
        return (
            "cache",
            obj.codec,
            obj.check_finite,
            obj.initial_blocks,
            obj.offset,
            obj.meta_state,
            _stream(obj.keys),
            _stream(obj.values),
        )
    if hasattr(obj, "codec_cache"):  # FlashCodecLayer
        kv = tuple(None if t is None else _bits(t) for t in (obj.keys, obj.values))
        return ("layer", obj.is_initialized, obj.dtype, str(obj.device), kv, snapshot(obj.codec_cache))
    if hasattr(obj, "layers"):  # a transformers Cache
        layers = []
        for layer in obj.layers:
            if hasattr(layer, "codec_cache"):
                layers.append(snapshot(layer))
            else:
                tensors = {k: _bits(v) for k, v in vars(layer).items() if isinstance(v, torch.Tensor)}
                layers.append((type(layer).__name__, getattr(layer, "is_initialized", None), tensors))
        return ("transformers-cache", type(obj).__name__, len(obj.layers), tuple(layers))
    if isinstance(obj, torch.nn.Module):
        return (
            "module",
            tuple(
                (name, tuple(sorted(vars(m))), vars(m).get("forward"), vars(m).get("generate"))
                for name, m in obj.named_modules()
            ),
        )
    if isinstance(obj, list):
        return [snapshot(x) for x in obj]
    return copy.deepcopy(obj)
