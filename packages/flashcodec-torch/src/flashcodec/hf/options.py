"""Layer options of the transformers backend: the cache-wide default and per-layer overrides.

A codec layer is built from one dict of :class:`flashcodec.CodecKVCache` arguments,
``{"codec": <codec object>, "check_finite": bool, "initial_blocks": int}``. A cache has a default
and, optionally, ``per_layer={layer_idx: override}`` where an override is a codec object or a
dict of ``CodecKVCache`` keywords merged over the default. Nothing here imports transformers.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from kvspec import KVConfigError

from ..codecs import BlockCodec, codec_class, make_codec, resolve_codec
from ..validate import check_bool, check_int

__all__ = ["CACHE_OPTIONS", "layer_options", "merge_override", "check_per_layer"]

#: ``CodecKVCache`` arguments that are not codec options
CACHE_OPTIONS = ("check_finite", "initial_blocks")


def layer_options(codec: BlockCodec, *, check_finite: Any = True, initial_blocks: Any = 16) -> dict[str, Any]:
    """Validated ``CodecKVCache`` arguments of one layer (checked as the cache checks them)."""
    if not isinstance(codec, BlockCodec):
        raise KVConfigError(f"codec must be a codec object such as JPEGCodec(...); got {codec!r}")
    return {
        "codec": codec,
        "check_finite": check_bool("check_finite", check_finite),
        "initial_blocks": check_int("initial_blocks", initial_blocks, low=1),
    }


def merge_override(
    defaults: Mapping[str, Any], base_keywords: Mapping[str, Any], override: BlockCodec | Mapping[str, Any]
) -> dict[str, Any]:
    """One layer's ``CodecKVCache`` arguments: ``override`` applied to ``defaults``.

    Args:
        defaults: the cache-wide layer options (see :func:`layer_options`).
        base_keywords: the default codec in the keyword form, as the caller gave it (or its
            ``config()`` when it was given as an object); dict overrides are merged over these,
            so ``{"block_size": 16}`` over ``keep_freqs`` left unset gives ``K = 16``.
        override: a codec object (replaces the default codec), or a dict holding ``codec`` or
            codec keywords, and/or ``check_finite`` / ``initial_blocks``. A dict that switches
            ``mode`` keeps only the default options the new codec also has, so ``{"mode": "png"}``
            over a jpeg k=2 default is not rejected for k=2.

    Raises ``KVConfigError`` (from the codec or the cache) for an invalid result.
    """
    if isinstance(override, BlockCodec):
        return layer_options(override, **{k: defaults[k] for k in CACHE_OPTIONS})
    keywords = dict(override)
    cache_options = {k: keywords.pop(k, defaults[k]) for k in CACHE_OPTIONS}
    if "codec" in keywords:
        codec = resolve_codec(keywords.pop("codec"), **keywords)
    elif keywords:
        base = dict(base_keywords)
        mode = keywords.get("mode", base.get("mode"))
        if mode != base.get("mode"):
            fields = {f.name for f in dataclasses.fields(codec_class(mode))}  # type: ignore[arg-type]
            base = {k: v for k, v in base.items() if k in fields}
        codec = make_codec(**{**base, **keywords})
    else:
        codec = defaults["codec"]
    return layer_options(codec, **cache_options)


def check_per_layer(
    per_layer: object,
    defaults: Mapping[str, Any],
    base_keywords: Mapping[str, Any],
    codec_layers: Iterable[int] | None = None,
    num_layers: int | None = None,
) -> dict[int, dict[str, Any]]:
    """Validate ``per_layer`` and return ``{layer_idx: layer options}`` for the layers it names.

    Args:
        per_layer: ``None`` or a mapping ``{layer_idx: codec object or {option: value}}``.
        defaults, base_keywords: as :func:`merge_override`.
        codec_layers: the layer indices that carry a codec, when known (from a config).
        num_layers: the model's layer count, when known.

    Raises ``KVConfigError`` naming the layer and the option when an entry is not valid, names a
    layer outside the model, or names a layer kept native (for example a linear-attention layer).
    """
    if per_layer is None:
        return {}
    if not isinstance(per_layer, Mapping):
        raise KVConfigError(
            "per_layer must be a dict {layer_idx: codec or {option: value}}; "
            f"got {type(per_layer).__name__}"
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
        if not isinstance(override, (BlockCodec, Mapping)):
            raise KVConfigError(
                f"per_layer[{idx}] must be a codec object or a dict of codec options; got {override!r}"
            )
        try:
            out[idx] = merge_override(defaults, base_keywords, override)
        except KVConfigError as err:
            raise KVConfigError(f"per_layer[{idx}]: {err}") from err
    return out
