"""Block codecs along the sequence axis: pure tensor maps, no cache state.

A codec object is the configuration: ``JPEGCodec(block_size=8, keep_freqs=2, quant_bits=8)``,
``PNGCodec(block_size=8, keep_ratio=1.0)``. :data:`CODECS` maps each ``mode`` name to its class;
adding a codec is one file here (a :class:`BlockCodec` subclass) plus one line in :data:`CODECS`.

The keyword form that caches also accept (``mode="jpeg", block_size=8, keep_freqs=2``) is turned
into a codec object by :func:`make_codec`; :func:`resolve_codec` is the one place a cache
chooses between ``codec=`` and that keyword form.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvspec import KVConfigError

from .base import BlockCodec, PartSpec
from .channel import ChannelInt4Codec
from .jpeg import JPEGCodec, dct_matrix
from .jpeg_mixed import MixedJPEGCodec, allocate_freq_bits, frequency_variances
from .jpeg_zero import ZeroPointJPEGCodec
from .kivi import KIVICodec, TokenIntCodec
from .png import PNGCodec, delta_variance_ratio
from .quant import dequantize_int8, quantize_int8

__all__ = [
    "BlockCodec",
    "PartSpec",
    "JPEGCodec",
    "MixedJPEGCodec",
    "ZeroPointJPEGCodec",
    "ChannelInt4Codec",
    "KIVICodec",
    "TokenIntCodec",
    "PNGCodec",
    "CODECS",
    "allocate_freq_bits",
    "frequency_variances",
    "KEYWORD_DEFAULTS",
    "codec_class",
    "make_codec",
    "resolve_codec",
    "keyword_values",
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
    "jpeg-zp": ZeroPointJPEGCodec,
    "chan4": ChannelInt4Codec,
    "kivi": KIVICodec,
    "token-int": TokenIntCodec,
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
    option of another registered codec is accepted only at that codec's default, because the
    keyword form of the caches passes every keyword; any other value raises ``KVConfigError``
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


class _KeywordDefault:
    """A keyword-form default: prints as its value (signatures read as usual) and tells "not passed"
    apart, so a call that gives ``codec=`` and a keyword of the keyword form is refused."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


#: the keyword form's defaults as markers: ``CodecKVCache(mode=KEYWORD_DEFAULTS["mode"], ...)``
KEYWORD_DEFAULTS: dict[str, Any] = {
    name: _KeywordDefault(value)
    for name, value in dict(
        mode="jpeg", block_size=8, keep_freqs=None, keep_ratio=1.0, quant_bits=None, delta_dtype=None
    ).items()
}


def keyword_values(keywords: dict[str, Any]) -> dict[str, Any]:
    """``keywords`` with every default marker replaced by its value."""
    return {k: v.value if isinstance(v, _KeywordDefault) else v for k, v in keywords.items()}


def resolve_codec(codec: BlockCodec | None, **keywords: Any) -> BlockCodec:
    """The codec a cache is built with: ``codec`` itself, or :func:`make_codec` of the keyword form.

    ``keywords``: the keyword-form arguments as the caller received them (default markers for the
    ones not passed). Raises ``KVConfigError`` when ``codec`` is not a codec object, or when
    ``codec`` and a keyword of the keyword form are both given.
    """
    if codec is None:
        return make_codec(**keyword_values(keywords))
    if not isinstance(codec, BlockCodec):
        raise KVConfigError(
            f"codec must be a codec object such as JPEGCodec(...) or PNGCodec(...); got {codec!r}"
        )
    given = {k: v for k, v in keywords.items() if not isinstance(v, _KeywordDefault)}
    if given:
        passed = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise KVConfigError(
            f"pass either codec= or the keyword form (mode=..., block_size=..., ...), not both; "
            f"got codec={codec!r} and {passed}"
        )
    return codec
