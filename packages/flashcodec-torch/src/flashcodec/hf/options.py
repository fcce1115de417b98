"""Codec options of the transformers backend: defaults, per-layer overrides, validation.

One dict of :class:`flashcodec.CodecKVCache` keywords describes a layer's codec. A cache has
default options and, optionally, ``per_layer={layer_idx: {...}}`` overrides merged over them.
Nothing here imports transformers.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from kvspec import KVConfigError

from ..cache import CodecKVCache

__all__ = ["OPTION_NAMES", "codec_options", "merge_options", "check_per_layer"]

#: every keyword a layer's codec accepts (``CodecKVCache``'s arguments)
OPTION_NAMES = (
    "mode",
    "block_size",
    "keep_freqs",
    "keep_ratio",
    "quant_bits",
    "delta_dtype",
    "check_finite",
    "initial_blocks",
)

# Options that belong to one mode: a per-layer override that switches the mode drops the
# defaults of the other mode, so {"mode": "png"} over a jpeg k=2 default is not rejected for k=2.
_MODE_ONLY = {"jpeg": ("keep_freqs", "quant_bits"), "png": ("keep_ratio", "delta_dtype")}


def codec_options(**options: Any) -> dict[str, Any]:
    """Validated ``CodecKVCache`` keywords (builds one codec to check them; raises ``KVConfigError``)."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise KVConfigError(f"unknown codec option(s) {unknown}; allowed: {list(OPTION_NAMES)}")
    CodecKVCache(**options)
    return dict(options)


def merge_options(defaults: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` updated with ``override``; switching ``mode`` drops the old mode's own options."""
    merged = dict(defaults)
    new_mode = override.get("mode", merged.get("mode"))
    if new_mode != merged.get("mode"):
        for name in _MODE_ONLY.get(merged.get("mode"), ()):
            merged.pop(name, None)
    merged.update(override)
    return merged


def check_per_layer(
    per_layer: object,
    defaults: Mapping[str, Any],
    codec_layers: Iterable[int] | None = None,
    num_layers: int | None = None,
) -> dict[int, dict[str, Any]]:
    """Validate ``per_layer`` and return ``{layer_idx: merged options}`` for the layers it names.

    Args:
        per_layer: ``None`` or a mapping ``{layer_idx: {option: value}}``.
        defaults: the cache-wide options each override is merged over.
        codec_layers: the layer indices that carry a codec, when known (from a config).
        num_layers: the model's layer count, when known.

    Raises ``KVConfigError`` naming the layer and the option when an entry is not valid, names a
    layer outside the model, or names a layer kept native (for example a linear-attention layer).
    """
    if per_layer is None:
        return {}
    if not isinstance(per_layer, Mapping):
        raise KVConfigError(
            f"per_layer must be a dict {{layer_idx: {{option: value}}}}; got {type(per_layer).__name__}"
        )
    allowed = None if codec_layers is None else sorted(codec_layers)
    out: dict[int, dict[str, Any]] = {}
    for idx, override in per_layer.items():
        if isinstance(idx, bool) or not isinstance(idx, numbers.Integral) or idx < 0:
            raise KVConfigError(f"per_layer keys must be layer indices (integers >= 0); got {idx!r}")
        idx = int(idx)
        if num_layers is not None and idx >= num_layers:
            raise KVConfigError(
                f"per_layer names layer {idx}, but the model has {num_layers} layers (0..{num_layers - 1})"
            )
        if allowed is not None and idx not in allowed:
            raise KVConfigError(
                f"per_layer names layer {idx}, which is kept native (not full attention); codec layers: {allowed}"
            )
        if not isinstance(override, Mapping):
            raise KVConfigError(f"per_layer[{idx}] must be a dict of codec options; got {override!r}")
        unknown = sorted(set(override) - set(OPTION_NAMES))
        if unknown:
            raise KVConfigError(
                f"per_layer[{idx}] has unknown option(s) {unknown}; allowed: {list(OPTION_NAMES)}"
            )
        merged = merge_options(defaults, override)
        try:
            CodecKVCache(**merged)
        except KVConfigError as err:
            raise KVConfigError(f"per_layer[{idx}]: {err}") from err
        out[idx] = merged
    return out
