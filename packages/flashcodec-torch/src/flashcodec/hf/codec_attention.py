"""Materialization-free decode for transformers: wrap attention forwards, attend on the stored rows.

``apply_codec_attention(model)`` puts a wrapper in the ``__dict__`` of every standard Llama /
Qwen-style attention module of that one model (the class and every other model are untouched).
On every step whose layer lives in a :class:`~flashcodec.hf.FlashCodecLayer`, the wrapper runs
the module's own projections, q/k norms and RoPE (the same submodules and the same
``apply_rotary_pos_emb`` of the module's modeling file), appends the new keys/values to the layer's
codec cache *without reading it*, and replaces the attention output before ``o_proj`` by

* :func:`flashcodec.attention.codec_decode_attention` for a decode step (one new token on a filled
  layer): attention on the stored rows, int8 codes and scales as stored;
* :func:`flashcodec.attention.codec_prefill_attention` for a multi-token step (prefill, chunked
  prefill, assisted decoding's verification): the archive is decoded a chunk at a time and folded
  into an online softmax, so no whole-history view exists at any point; with the layer's
  ``step_raw`` (the default) the step's own tokens are attended as computed, not as stored.

Everything else falls back to the original forward, unchanged:

* a cache that is not a ``FlashCodecCache``, or a layer that is not a codec layer (hybrid models);
* training mode, sliding-window layers, ``output_attentions``, and masks that are not a plain
  tensor over exactly the cached tokens (decode: ``[B, 1|H, 1, S]`` or ``[B, S]``; multi-token:
  None = causal, ``[B, 1|H, s, S]`` or a ``[B, S]`` padding mask combined with the causal rule).

The reconstructed view a fallback call builds through ``cache.update`` is needed only inside that
call: the wrapper releases it as soon as the original forward returns.

Batches of any size are served; left padding reaches the kernel as a per-sequence key mask.
``remove_codec_attention(model)`` puts back exactly what each module's ``__dict__`` held.

Which modules: the classes in :data:`SUPPORTED_ATTENTION` (their forward is exactly q/k/v
projections, optional per-head RMS norms on q and k, RoPE, cache update, softmax attention,
``o_proj``). Other attention classes (gated outputs, soft-capping, MLA, ...) are left alone:
re-deriving their forward here would be guesswork.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from kvspec import KVConfigError

from ..attention import BACKENDS, codec_decode_attention, codec_prefill_attention
from .cache import FlashCodecCache
from .layer import FlashCodecLayer

__all__ = [
    "SUPPORTED_ATTENTION",
    "apply_codec_attention",
    "remove_codec_attention",
    "codec_attention_modules",
    "CodecAttentionStats",
]

#: attention classes whose forward the wrapper re-derives exactly (by class name)
SUPPORTED_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")

_MISSING = object()
_WRAPPER_ATTR = "__flashcodec_codec_attention__"


class CodecAttentionStats:
    """Counts of calls served without a view, and of calls that fell back (per model).

    ``coded``: decode steps (one token) served on the stored rows; ``chunked``: multi-token steps
    (prefill, chunked prefill, verification) served chunk by chunk; ``fallbacks`` maps the reason
    (a short string) to a count, so a test or a user can see why a step took the original forward.
    """

    def __init__(self) -> None:
        self.coded = 0
        self.chunked = 0
        self.fallbacks: dict[str, int] = {}

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def __repr__(self) -> str:
        return f"CodecAttentionStats(coded={self.coded}, chunked={self.chunked}, fallbacks={self.fallbacks})"


def _is_supported(module: torch.nn.Module) -> bool:
    if type(module).__name__ not in SUPPORTED_ATTENTION:
        return False
    needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")
    if not all(hasattr(module, name) for name in needed):
        return False
    rope = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
    return callable(rope)


def _check_module(model: object, what: str) -> None:
    """``KVConfigError`` unless ``model`` is a ``torch.nn.Module`` (the wrappers live in its modules)."""
    if not isinstance(model, torch.nn.Module):
        raise KVConfigError(f"{what}: model must be a torch.nn.Module; got {type(model).__name__}")


def codec_attention_modules(model: torch.nn.Module) -> list[str]:
    """Names of the modules of ``model`` that currently carry the codec-attention wrapper."""
    _check_module(model, "codec_attention_modules")
    return [name for name, m in model.named_modules() if hasattr(vars(m).get("forward"), _WRAPPER_ATTR)]


def _key_mask(attention_mask: Any, batch: int, total: int) -> tuple[bool, torch.Tensor | None]:
    """``(usable, mask [B, S] or None)`` from the mask transformers hands the attention module."""
    if attention_mask is None:
        return True, None
    if not isinstance(attention_mask, torch.Tensor):  # e.g. flex attention's BlockMask
        return False, None
    if attention_mask.dim() == 4:
        if attention_mask.shape[0] != batch or attention_mask.shape[1] != 1 or attention_mask.shape[2] != 1:
            return False, None
        row = attention_mask[:, 0, 0, :]
    elif attention_mask.dim() == 2:  # flash-attention style padding mask, 1 = keep
        row = attention_mask
        if not row.is_floating_point():
            row = row.bool()
    else:
        return False, None
    if row.shape != (batch, total):
        return False, None
    return True, row


def _bound_arguments(original: Callable, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        return None
    found = dict(bound.arguments)
    found.update(found.pop("kwargs", {}) or {})
    return found


def _unsupported_reason(
    module: torch.nn.Module, hidden: Any, cache: Any, position_embeddings: Any, found: dict[str, Any]
) -> str | None:
    """Why this call must take the original forward, or None when the coded path serves it."""
    if not isinstance(cache, FlashCodecCache):
        return "no cache" if cache is None else "not a FlashCodecCache"
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[1] == 0:
        return "not a [B, s, hidden] step"
    idx = module.layer_idx
    lazy = cache.layer_types is None and idx >= len(cache.layers)  # built on its first update
    layer = None if lazy else cache.layers[idx] if idx < len(cache.layers) else None
    if not lazy and not isinstance(layer, FlashCodecLayer):
        return "not a codec layer"
    if module.training:
        return "training"
    if getattr(module, "sliding_window", None) is not None:
        return "sliding window"
    if found.get("output_attentions"):
        return "output_attentions"
    if position_embeddings is None:
        return "no position embeddings"
    stream = None if layer is None else layer.codec_cache.keys
    if stream is not None and (module.q_proj.weight.dtype, hidden.device, hidden.shape[0]) != (
        stream.dtype,
        stream.device,
        stream.batch,
    ):
        return "dtype, device or batch differs from the cache"
    return None


def _step_mask(
    attention_mask: Any, batch: int, heads: int, s: int, total: int
) -> tuple[bool, torch.Tensor | None]:
    """``(usable, mask)`` for a multi-token step: None (causal) or ``[B, 1|Hq, s, S]`` bool / additive."""
    if attention_mask is None:
        return True, None
    if not isinstance(attention_mask, torch.Tensor):
        return False, None
    if attention_mask.dim() == 4:
        ok = attention_mask.shape[0] == batch and attention_mask.shape[1] in (1, heads)
        return (
            (True, attention_mask) if ok and tuple(attention_mask.shape[2:]) == (s, total) else (False, None)
        )
    if attention_mask.dim() == 2 and tuple(attention_mask.shape) == (batch, total):
        # a [B, S] padding mask (1 = keep): combined here with the causal rule
        keep = attention_mask.bool() if not attention_mask.is_floating_point() else attention_mask == 0
        pos_q = torch.arange(total - s, total, device=attention_mask.device)
        causal = torch.arange(total, device=attention_mask.device)[None, :] <= pos_q[:, None]
        return True, (causal[None, None] & keep[:, None, None, :])
    return False, None


def _release_view(layer: FlashCodecLayer) -> None:
    """Drop the layer's memoized ``[B, H, S, D]`` reconstruction and the layer's references to it."""
    layer.codec_cache.release_view()
    if isinstance(layer.keys, torch.Tensor) and isinstance(layer.values, torch.Tensor):
        # fresh empty tensors: even a zero-length slice of the view would keep its storage alive
        b, h, _, d = layer.keys.shape
        layer.keys = layer.keys.new_empty((b, h, 0, d))
        layer.values = layer.values.new_empty((b, h, 0, layer.values.shape[-1]))


def _release_after_original(found: dict[str, Any], module: torch.nn.Module) -> None:
    """After a call served by the original forward (the prefill, a multi-token step), free the view
    its ``cache.update`` built for this layer: the coded decode steps never read it again."""
    cache = found.get("cache", found.get("past_key_values"))
    if isinstance(cache, FlashCodecCache) and module.layer_idx < len(cache.layers):
        layer = cache.layers[module.layer_idx]
        if isinstance(layer, FlashCodecLayer) and layer.codec_cache.offset:
            _release_view(layer)


def _decode_on_rows(
    module: torch.nn.Module,
    found: dict[str, Any],
    backend: str,
    stats: CodecAttentionStats,
) -> tuple[torch.Tensor, None] | None:
    """The materialization-free step (a decode on the stored rows, a multi-token step over the
    archive in chunks), or None (nothing changed) when it does not apply."""
    hidden = found.get("hidden_states")
    cache = found.get("cache", found.get("past_key_values"))
    position_embeddings = found.get("position_embeddings")
    reason = _unsupported_reason(module, hidden, cache, position_embeddings, found)
    if reason is not None:
        stats.fallback(reason)
        return None
    if module.layer_idx >= len(cache.layers):
        cache.ensure_layers(module.layer_idx)
    layer = cache.layers[module.layer_idx]
    codec_cache = layer.codec_cache
    batch, steps = hidden.shape[0], hidden.shape[1]
    total = codec_cache.offset + steps
    decode = steps == 1 and codec_cache.offset > 0
    if decode:
        usable, mask = _key_mask(found.get("attention_mask"), batch, total)
        if not usable:
            stats.fallback("attention mask layout")
            return None

    # The module's own projections, norms and RoPE, in the order its forward applies them.
    input_shape = hidden.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query = module.q_proj(hidden).view(hidden_shape)
    if not decode:
        # the query heads this process computes, from the tensor: under tensor parallel the
        # projection's weight may report the global shape (a DTensor) while the output holds
        # only this rank's heads
        usable, mask = _step_mask(found.get("attention_mask"), batch, query.shape[2], steps, total)
        if not usable:
            stats.fallback("attention mask layout")
            return None
    key = module.k_proj(hidden).view(hidden_shape)
    if getattr(module, "q_norm", None) is not None:
        query = module.q_norm(query)
    if getattr(module, "k_norm", None) is not None:
        key = module.k_norm(key)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    value = module.v_proj(hidden).view(hidden_shape).transpose(1, 2)
    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    cos, sin = position_embeddings
    query, key = rope(query, key, cos, sin)

    codec_cache.append(key, value)  # validates first: a rejected input changes nothing
    if not layer.is_initialized:
        layer.lazy_initialization(key, value)
    _release_view(layer)  # in case something rebuilt it since (a crop, a beam reorder)

    if decode:
        out = codec_decode_attention(
            query, codec_cache.keys, codec_cache.values, scale=module.scaling, key_mask=mask, backend=backend
        )
        stats.coded += 1
    else:
        raw = dict(step_keys=key, step_values=value) if layer.step_raw else {}
        out = codec_prefill_attention(
            query, codec_cache.keys, codec_cache.values, scale=module.scaling, attn_mask=mask, **raw
        )
        stats.chunked += 1
    out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
    return module.o_proj(out), None


def apply_codec_attention(model: torch.nn.Module, *, backend: str = "auto") -> CodecAttentionStats:
    """Wrap the forward of every supported attention module of ``model`` (this instance only).

    Args:
        model: a transformers model (any module tree holding Llama / Qwen-style attention).
        backend: ``"auto"`` (Triton on CUDA when importable, torch otherwise), ``"torch"`` or ``"triton"``.

    Returns the model's :class:`CodecAttentionStats` (decode calls served on the stored rows and
    fallbacks by reason). Applying again replaces the wrappers (new backend, fresh stats). Warns
    when no module is supported (nothing is wrapped then). Decode steps only take the new path with
    a :class:`~flashcodec.hf.FlashCodecCache` (explicit, or from ``apply_flash_codec``).
    """
    _check_module(model, "apply_codec_attention")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise KVConfigError(f"backend must be one of {BACKENDS}; got {backend!r}")
    remove_codec_attention(model)
    stats = CodecAttentionStats()
    wrapped = 0
    for module in model.modules():
        if _is_supported(module):
            _wrap(module, backend, stats)
            wrapped += 1
    if not wrapped:
        warnings.warn(
            f"apply_codec_attention: no attention module of {type(model).__name__} is one of {SUPPORTED_ATTENTION}; "
            "nothing was wrapped and every step keeps the materialized path",
            stacklevel=2,
        )
    return stats


def _wrap(module: torch.nn.Module, backend: str, stats: CodecAttentionStats) -> None:
    instance = vars(module)
    before = instance.get("forward", _MISSING)
    original = before if before is not _MISSING else type(module).forward.__get__(module, type(module))
    module_ref = weakref.ref(module)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        mod = module_ref()
        found = _bound_arguments(original, args, kwargs)
        result = None if found is None else _decode_on_rows(mod, found, backend, stats)
        if result is not None:
            return result
        out = original(*args, **kwargs)
        if found is not None:
            _release_after_original(found, mod)
        return out

    setattr(forward, _WRAPPER_ATTR, (before, stats))
    instance["forward"] = forward


def remove_codec_attention(model: torch.nn.Module) -> int:
    """Undo :func:`apply_codec_attention`: every module's ``forward`` is again exactly what it was.

    Returns the number of modules restored (0 when the model was not wrapped).
    """
    _check_module(model, "remove_codec_attention")
    restored = 0
    for module in model.modules():
        current = vars(module).get("forward")
        marker = getattr(current, _WRAPPER_ATTR, None)
        if marker is None:
            continue
        before, _ = marker
        if before is _MISSING:
            del vars(module)["forward"]
        else:
            vars(module)["forward"] = before
        restored += 1
    return restored
