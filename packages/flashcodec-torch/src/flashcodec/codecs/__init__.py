"""Block codecs along the sequence axis: pure tensor maps, no cache state.

A codec object is the configuration: ``JPEGCodec(block_size=8, keep_freqs=2, quant_bits=8)``,
``PNGCodec(block_size=8, keep_ratio=1.0)``. :data:`CODECS` maps each ``mode`` name to its class;
adding a codec is one file here (a :class:`BlockCodec` subclass) plus one line in :data:`CODECS`.

The keyword form that caches also accept (``mode="jpeg", block_size=8, keep_freqs=2``, any field
of any registered codec) is turned into a codec object by :func:`keyword_codec`, the one place a
cache chooses between ``codec=`` and that keyword form (:func:`make_codec` builds it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvspec import KVConfigError

from .base import BlockCodec, PartSpec
from .chan_int4 import ChannelInt4Codec
from .jpeg import JPEGCodec, dct_matrix
from .jpeg_int4z import ZeroPointJPEGCodec
from .jpeg_mixed import MixedJPEGCodec, allocate_freq_bits, frequency_variances
from .kivi import KIVICodec, TokenIntCodec
from .png import PNGCodec, delta_variance_ratio
from .quant import dequantize_int8, quantize_int8
from .rotated import RotatedKIVICodec
from .turboquant import TurboQuantCodec

__all__ = [
    "BlockCodec",
    "PartSpec",
    "JPEGCodec",
    "MixedJPEGCodec",
    "ZeroPointJPEGCodec",
    "ChannelInt4Codec",
    "KIVICodec",
    "TokenIntCodec",
    "RotatedKIVICodec",
    "TurboQuantCodec",
    "PNGCodec",
    "CODECS",
    "allocate_freq_bits",
    "frequency_variances",
    "KEYWORD_POSITIONS",
    "codec_class",
    "make_codec",
    "keyword_codec",
    "keyword_options",
    "resolve_codec",
    "dct_matrix",
    "delta_variance_ratio",
    "quantize_int8",
    "dequantize_int8",
]

#: the codec registry: ``mode`` name -> codec class (each key equals its class's ``mode``)
CODECS: dict[str, type[BlockCodec]] = {
    "jpeg": JPEGCodec,
    "png": PNGCodec,
    "jpeg-mixed": MixedJPEGCodec,
    "jpeg-int4z": ZeroPointJPEGCodec,
    "chan-int4": ChannelInt4Codec,
    "kivi": KIVICodec,
    "token-int": TokenIntCodec,
    "kivi-rot": RotatedKIVICodec,
    "turboquant": TurboQuantCodec,
}


def codec_class(mode: object) -> type[BlockCodec]:
    """The registered codec class for ``mode``; ``KVConfigError`` naming the registered modes otherwise."""
    if not isinstance(mode, str) or mode not in CODECS:
        raise KVConfigError(f"mode must be one of {tuple(CODECS)}; got {mode!r}")
    return CODECS[mode]


def _field_defaults(cls: type[BlockCodec]) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[arg-type]


def make_codec(mode: str = "jpeg", **options: Any) -> BlockCodec:
    """Build a codec from the keyword form: ``make_codec("jpeg", block_size=8, keep_freqs=2)``.

    ``options`` are the fields of the codec class registered for ``mode`` (jpeg: ``block_size``,
    ``keep_freqs``, ``quant_bits``; png: ``block_size``, ``keep_ratio``, ``delta_dtype``). An
    option of another registered codec is accepted only at that codec's default, where it changes
    nothing (``keep_freqs=None`` with ``mode="png"``); any other value raises ``KVConfigError``
    (say ``keep_ratio=0.5`` with ``mode="jpeg"``) instead of being silently ignored.
    """
    cls = codec_class(mode)
    own = _field_defaults(cls)
    kwargs = {}
    for name, value in options.items():
        if name in own:
            kwargs[name] = value
            continue
        owners = [m for m, other in CODECS.items() if name in _field_defaults(other)]
        if not owners:
            raise KVConfigError(
                f"unknown codec option {name!r} (got {name}={value!r}); mode={mode!r} takes {sorted(own)}"
            )
        if not any(_equal(value, _field_defaults(CODECS[m])[name]) for m in owners):
            only = " or ".join(repr(m) for m in owners)
            raise KVConfigError(
                f"{name} applies to mode={only} only; got {name}={value!r} with mode={mode!r}"
            )
    return cls(**kwargs)


def _equal(value: Any, default: Any) -> bool:
    """Whether ``value`` is ``default`` for the keyword form (a bool never counts as a number)."""
    try:
        return bool(value == default) and type(value) is not bool
    except Exception:  # e.g. a tensor, whose == is elementwise: not a default
        return False


#: the keyword form's positional parameters, in the order the caches take them
#: (``CodecKVCache("jpeg", 8, 2)`` is ``mode="jpeg", block_size=8, keep_freqs=2``)
KEYWORD_POSITIONS = ("mode", "block_size", "keep_freqs", "keep_ratio", "quant_bits")


def keyword_options(args: tuple[Any, ...] = (), options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The keyword form as given, as one dict: ``args`` named by :data:`KEYWORD_POSITIONS`, then
    ``options`` (any field of any registered codec, and ``mode``). Nothing is validated but the
    form: ``KVConfigError`` for more positional values than there are names, or a name given twice."""
    if len(args) > len(KEYWORD_POSITIONS):
        raise KVConfigError(
            f"the keyword form takes at most {len(KEYWORD_POSITIONS)} positional values "
            f"{KEYWORD_POSITIONS}; got {len(args)}: {args!r:.200}"
        )
    given = dict(zip(KEYWORD_POSITIONS, args, strict=False))  # fewer values than names
    for name, value in (options or {}).items():
        if name in given:
            raise KVConfigError(f"{name} is given twice (positionally and as {name}={value!r})")
        given[name] = value
    return given


def keyword_codec(*args: Any, codec: BlockCodec | None = None, **options: Any) -> BlockCodec:
    """The codec a cache is built with: ``codec`` itself, or the codec the keyword form names.

    The one place the keyword form becomes a codec: :class:`flashcodec.CodecKVCache`,
    :class:`flashcodec.hf.FlashCodecCache` and :func:`flashcodec.hf.apply_flash_codec` pass their
    positional values (``mode, block_size, keep_freqs, keep_ratio, quant_bits``) and codec keywords
    here unchanged. ``options`` are the fields of the codec registered for ``mode`` (default
    ``"jpeg"``; see :func:`make_codec`). ``KVConfigError`` when ``codec`` is not a codec object,
    when ``codec`` and a keyword of the keyword form are both given, or for a bad keyword.

        keyword_codec("jpeg", 8, 2) == keyword_codec(mode="jpeg", block_size=8, keep_freqs=2)
        keyword_codec(mode="kivi", key_bits=8, value_bits=8) == KIVICodec(key_bits=8, value_bits=8)
    """
    return resolve_codec(codec, **keyword_options(args, options))


def resolve_codec(codec: BlockCodec | None, **keywords: Any) -> BlockCodec:
    """``codec`` itself (checked to be a codec object), or :func:`make_codec` of ``keywords`` (the
    keyword form as given, by name); giving both is a ``KVConfigError``."""
    if codec is None:
        return make_codec(**keywords)
    if not isinstance(codec, BlockCodec):
        raise KVConfigError(
            f"codec must be a codec object such as JPEGCodec(...) or PNGCodec(...); got {codec!r}"
        )
    if keywords:
        passed = ", ".join(f"{k}={v!r}" for k, v in keywords.items())
        raise KVConfigError(
            f"pass either codec= or the keyword form (mode=..., block_size=..., ...), not both; "
            f"got codec={codec!r} and {passed}"
        )
    return codec
