"""Attention on the codes for any transformers model that calls the attention interface.

``apply_codec_attention(model)`` registers an attention implementation with transformers'
``AttentionInterface`` (``codec_attention_<base>``, e.g. ``codec_attention_sdpa``, with the base
implementation's mask function) and switches this one model to it with
``model.set_attn_implementation``; a forward hook pair on each attention module marks its calls
(:mod:`flashcodec.hf.codes_step`). Every modern transformers model calls
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)`` after its own projections,
norms, RoPE and ``cache.update``, so one mechanism covers every family that does: GQA,
qk-norm, partial rotary, sliding masks. During a marked eval forward a
:class:`~flashcodec.hf.FlashCodecLayer` stores the step without reading anything back and hands
the step's tensors to the attention function, which attends

* with :func:`flashcodec.attention.codec_decode_attention` on a decode step (one new token on a
  filled layer): on the stored rows, int8 codes and scales as stored;
* with :func:`flashcodec.attention.codec_prefill_attention` on a multi-token step (prefill,
  chunked prefill, verification): the archive a chunk at a time in an online softmax; with the
  layer's ``step_raw`` (the default) the step's own tokens as computed.

Logit soft-capping (Gemma 2) and attention-sink logits (gpt-oss) are applied on the codes. Calls
the coded kernels do not serve (dropout, a mask layout they do not take, another dtype or device) decode that layer's history for that call
only, run the base implementation on it and drop it again, so the cache never holds more than
its codes; ``CodecAttentionStats.fallbacks`` counts them by reason. Layers that are not codec
layers (sliding-window, linear, any other cache) go to the base implementation unchanged.

``remove_codec_attention(model)`` puts the model's attention implementation back and removes
the hooks. A model whose attention does not go through the interface is refused at apply time.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

import torch
from kvspec import KVConfigError

from ..attention import BACKENDS, codec_decode_attention, codec_prefill_attention
from .codes_step import CODES_STEP, CodesStep, step_layer
from .layer import FlashCodecLayer
from .sliding_layer import FlashCodecSlidingLayer

__all__ = [
    "IMPLEMENTATION_PREFIX",
    "check_codec_attention",
    "apply_codec_attention",
    "remove_codec_attention",
    "codec_attention_modules",
    "CodecAttentionStats",
]

#: registered implementation names are this prefix plus the base implementation's name (no
#: "flash" in it: transformers reads that substring as a request for flash-attention)
IMPLEMENTATION_PREFIX = "codec_attention_"


class CodecAttentionStats:
    """Counts of calls served on the codes, and of calls that fell back (per model).

    ``coded``: decode steps (one token) served on the stored rows; ``chunked``: multi-token steps
    (prefill, chunked prefill, verification) served chunk by chunk; ``fallbacks`` maps the reason
    (a short string) to a count, so a test or a user can see why a step took another path.
    """

    def __init__(self) -> None:
        self.coded = 0
        self.chunked = 0
        self.fallbacks: dict[str, int] = {}

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def __repr__(self) -> str:
        return f"CodecAttentionStats(coded={self.coded}, chunked={self.chunked}, fallbacks={self.fallbacks})"


# model -> (base implementation name, hook handles, stats); weak, so a dropped model is forgotten
_APPLIED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, list[Any], CodecAttentionStats]] = (
    weakref.WeakKeyDictionary()
)


def _check_module(model: object, what: str) -> None:
    """``KVConfigError`` unless ``model`` is a ``torch.nn.Module``."""
    if not isinstance(model, torch.nn.Module):
        raise KVConfigError(f"{what}: model must be a torch.nn.Module; got {type(model).__name__}")


def codec_attention_modules(model: torch.nn.Module) -> list[str]:
    """Names of the attention modules of ``model`` that attend on the codes (none unless applied)."""
    _check_module(model, "codec_attention_modules")
    return [name for name, _ in _attention_modules(model)] if model in _APPLIED else []


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The self-attention modules of a transformers model: the modules that carry a
    ``layer_idx`` and a config and whose class is an attention class (``*Attention*``)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if hasattr(m, "layer_idx") and hasattr(m, "config") and "Attention" in type(m).__name__
    ]


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


def _base_function(module: torch.nn.Module, base: str) -> Any:
    """The attention function ``base`` names, as the module would have called it: a registered
    implementation, else the module's own modeling file's ``eager_attention_forward``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[base]
    return sys.modules[type(module).__module__].eager_attention_forward


def _materialized(
    layer: FlashCodecLayer, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's whole history for one call (the step's own tokens as given with ``step_raw``)."""
    keys, values = layer.codec_cache.read()
    steps = key.shape[-2]
    before = keys.shape[-2] - steps
    if layer.step_raw and (steps > 1 or before == 0):
        keys = torch.cat([keys[:, :, :before], key], dim=2)
        values = torch.cat([values[:, :, :before], value], dim=2)
    return keys, values


def _unsupported(
    base: str, module: torch.nn.Module, query: torch.Tensor, layer: FlashCodecLayer, kwargs: dict
) -> str | None:
    """Why the coded kernels cannot serve this call, or None."""
    if kwargs.get("dropout") or module.training:
        return "dropout"
    if kwargs.get("output_attentions"):
        return "output_attentions"
    if isinstance(layer, FlashCodecSlidingLayer) and "flash" in base:
        return "sliding window without a mask"  # flash-attention masks leave the window to the kernel
    stream = layer.codec_cache.keys
    if (query.dtype, query.device, query.shape[0]) != (stream.dtype, stream.device, stream.batch):
        return "dtype, device or batch differs from the cache"
    return None


def _codes_attention(
    base: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None] | Any:
    """The registered attention function: ``query [B, Hq, s, D]`` against a codec layer's codes
    (``key`` / ``value`` are the step's tagged tensors), or the base function for anything else.
    Returns ``([B, s, Hq, Dv], None)`` like transformers' implementations."""
    step = CODES_STEP.get()
    layer = step_layer(key)
    if layer is None or step is None:
        if step is not None:
            step.stats.fallback("not a codec layer" if step.active else "training")
        return _base_function(module, base)(module, query, key, value, attention_mask, **kwargs)
    stats = step.stats
    batch, steps = query.shape[0], query.shape[2]
    total = layer.codec_cache.offset
    decode = steps == 1 and total > 1
    reason = _unsupported(base, module, query, layer, kwargs)
    if reason is None:
        if decode:
            usable, mask = _key_mask(attention_mask, batch, total)
        else:
            usable, mask = _step_mask(attention_mask, batch, query.shape[1], steps, total)
        reason = None if usable else "attention mask layout"
    if reason is not None:
        stats.fallback(reason)
        keys, values = _materialized(layer, key, value)
        try:
            return _base_function(module, base)(module, query, keys, values, attention_mask, **kwargs)
        finally:
            del keys, values
            layer.release_view()
    scale = kwargs.get("scaling")
    # Gemma 2's logit soft-capping and gpt-oss's per-head sink logits, as its eager function applies them
    extras = dict(softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    plain = extras["softcap"] is None and extras["sinks"] is None  # what the Triton kernel takes
    if decode:
        out = codec_decode_attention(
            query,
            layer.codec_cache.keys,
            layer.codec_cache.values,
            scale=scale,
            key_mask=mask,
            backend=step.backend if plain else "auto",
            **extras,
        )
        stats.coded += 1
    else:
        raw = dict(step_keys=key, step_values=value) if layer.step_raw else {}
        out = codec_prefill_attention(
            query,
            layer.codec_cache.keys,
            layer.codec_cache.values,
            scale=scale,
            attn_mask=mask,
            **raw,
            **extras,
        )
        stats.chunked += 1
    return out.transpose(1, 2).contiguous(), None


def _register(base: str) -> str:
    """Register ``codec_attention_<base>`` (attention and mask functions); returns the name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = IMPLEMENTATION_PREFIX + base
    AttentionInterface.register(name, functools.partial(_codes_attention, base))
    if base in ALL_MASK_ATTENTION_FUNCTIONS:  # the masks the base implementation expects
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def _attention_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return None
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def check_codec_attention(model: torch.nn.Module, backend: str = "auto") -> tuple[Any, list]:
    """Everything :func:`apply_codec_attention` checks, changing nothing: ``KVConfigError`` for a
    bad backend or a model whose attention does not go through transformers' interface.
    Returns the model's text config and its attention modules ``[(name, module)]``."""
    _check_module(model, "apply_codec_attention")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise KVConfigError(f"backend must be one of {BACKENDS}; got {backend!r}")
    config = _attention_config(model)
    modules = _attention_modules(model)
    can_switch = getattr(type(model), "_can_set_attn_implementation", lambda: True)()
    if config is None or not modules or not can_switch:
        raise KVConfigError(
            f"attention on the codes: {type(model).__name__} does not call transformers' attention "
            "interface (set_attn_implementation cannot switch it), so it cannot be installed; "
            "pass attention='materialized' (or a FlashCodecCache alone) for the decoded-view path"
        )
    return config, modules


def apply_codec_attention(model: torch.nn.Module, *, backend: str = "auto") -> CodecAttentionStats:
    """Make ``model`` (this instance only) attend on the codes of every codec layer.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention goes through transformers'
            attention interface (every family that supports ``set_attn_implementation``).
        backend: ``"auto"`` (Triton on CUDA when importable, torch otherwise), ``"torch"`` or ``"triton"``.

    Returns the model's :class:`CodecAttentionStats`. Applying again replaces the backend and
    the stats. ``KVConfigError`` (nothing changed) when the model cannot switch its attention
    implementation. Steps only take the codes with a :class:`~flashcodec.hf.FlashCodecCache`
    (explicit, or from ``apply_flash_codec``).
    """
    config, modules = check_codec_attention(model, backend)
    previous = _APPLIED.get(model)
    base = previous[0] if previous is not None else config._attn_implementation or "eager"
    remove_codec_attention(model)
    model.set_attn_implementation(_register(base))
    stats = CodecAttentionStats()
    tokens: list[Any] = []  # one per forward in progress (a forward may run inside another)

    def enter(module: torch.nn.Module, args: Any) -> None:
        tokens.append(CODES_STEP.set(CodesStep(not module.training, backend, stats)))

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        CODES_STEP.reset(tokens.pop())

    # on every attention module, so a call to the base model or to one layer is marked too
    handles = []
    for _, module in modules:
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    _APPLIED[model] = (base, handles, stats)
    return stats


def remove_codec_attention(model: torch.nn.Module) -> int:
    """Undo :func:`apply_codec_attention`: the attention implementation it replaced is set again
    and its hooks removed. Returns how many attention modules attended on the codes (0 when the
    model was not set up)."""
    _check_module(model, "remove_codec_attention")
    modules = len(codec_attention_modules(model))
    applied = _APPLIED.pop(model, None)
    if applied is None:
        return 0
    base, handles, _ = applied
    for handle in handles:
        handle.remove()
    model.set_attn_implementation(base)
    return modules
