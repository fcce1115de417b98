"""The flashcodec tiers: the one place a storage tier is defined.

A tier is a named codec with a one-line description and the attention it is measured with.
:data:`TIERS` holds the few a user should pick from: the default, the tiers on the measured
bytes/KL frontier, and the reference description's own settings (its png and jpeg codecs);
configurations kept only for studies live with the benchmarks that measure them. The conformance
adapter (:mod:`flashcodec.kvspec_adapter`) adds capabilities and tolerances to these tiers, and
command lines, benchmarks and tests read them from here.

    from flashcodec.tiers import TIERS, tier
    cache = CodecKVCache(codec=tier("jpeg-k2-int8").codec)
    apply_flash_codec(model, codec=tier("kivi64r-k8v8-w32-s8").codec, attention="codes")

Attention is a field, not part of the name: ``attention="codes"`` attends on the stored codes
(decode steps on the stored rows, multi-token steps over the archive in chunks:
:func:`flashcodec.hf.apply_codec_attention`), ``"materialized"`` on a decoded K/V view. Storage is
the codec's either way. Each tier carries the attention it is measured with;
``tier(name, attention=...)`` returns it with the other one. Adding a tier is one row of
``_TABLE`` below.

The KIVI names read ``kivi<r>[r]-k<key bits>v<value bits>-w<window>[i8][-s8[z4]]``: ``r`` a Hadamard
rotation of the channels, ``w`` newest tokens kept out of the blocks (``w0``: only the incomplete
block), ``i8`` those in int8 per token (raw otherwise), ``s8`` 8-bit scales and zero points
(``side_bits=8``), ``z4`` the values' zero points in 4 bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from kvspec import KVConfigError

from .codecs import BlockCodec, JPEGCodec, PNGCodec, RotatedKIVICodec

__all__ = [
    "ATTENTIONS",
    "DEFAULT_TIER",
    "RETIRED_ATTENTION_SUFFIX",
    "Tier",
    "TIERS",
    "check_attention",
    "default_codec",
    "make_registry",
    "tier",
    "tier_names",
]

#: what attention runs on: the stored codes, or a decoded (materialized) K/V view
ATTENTIONS = ("codes", "materialized")

#: the name suffix that once chose attention on the codes: a name ending in it gets an error naming
#: the attention field, and results files written before the field existed are read with it
RETIRED_ATTENTION_SUFFIX = "-mf"


def _refuse_attention_suffix(name: str, what: str) -> None:
    if name.endswith(RETIRED_ATTENTION_SUFFIX):
        raise KVConfigError(
            f"{what} {name!r}: attention is no longer part of a tier's name; name the tier "
            f"{name.removesuffix(RETIRED_ATTENTION_SUFFIX)!r} and choose attention='codes' "
            "(flashcodec compare --attention codes, apply_flash_codec(..., attention='codes'))"
        )


def check_attention(attention: object, what: str = "attention") -> str:
    """``attention`` when it is one of :data:`ATTENTIONS`; ``KVConfigError`` naming them otherwise."""
    if attention not in ATTENTIONS:
        raise KVConfigError(f"{what} must be one of {ATTENTIONS}; got {attention!r}")
    return attention  # type: ignore[return-value]


@dataclass(frozen=True)
class Tier:
    """One named configuration.

    Attributes:
        name: the tier's name everywhere (results files, command lines, charts, tests).
        description: one line saying what is stored.
        codec: the codec every compressed layer uses.
        attention: ``"codes"`` (decode steps attend on the stored rows, multi-token steps on the
            archive decoded a chunk at a time) or ``"materialized"`` (a reconstructed K/V view;
            transformers backend only; storage is the codec's either way): the attention the
            tier is measured with, and what ``flashcodec compare`` runs unless told otherwise.
    """

    name: str
    description: str
    codec: BlockCodec
    attention: str = "codes"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip():
            raise KVConfigError(
                f"Tier name must be a non-empty string without outer spaces; got {self.name!r}"
            )
        _refuse_attention_suffix(self.name, "Tier name")
        if not isinstance(self.description, str) or not self.description or "\n" in self.description:
            raise KVConfigError(f"Tier description must be one non-empty line; got {self.description!r}")
        if not isinstance(self.codec, BlockCodec):
            raise KVConfigError(f"Tier codec must be a codec object (a BlockCodec); got {self.codec!r}")
        check_attention(self.attention, f"Tier {self.name!r} attention")

    def with_attention(self, attention: str) -> Tier:
        """This tier (same name, same codec) with ``attention`` (one of :data:`ATTENTIONS`)."""
        return dataclasses.replace(self, attention=check_attention(attention))


def make_registry(*tiers: Tier) -> dict[str, Tier]:
    """Tiers by name, in the order given; ``KVConfigError`` when a name repeats."""
    out: dict[str, Tier] = {}
    for t in tiers:
        if not isinstance(t, Tier):
            raise KVConfigError(f"a registry holds Tier objects; got {t!r}")
        if t.name in out:
            raise KVConfigError(f"tier name {t.name!r} is defined twice")
        out[t.name] = t
    return out


def _kivi64r(key_bits: int, value_bits: int, **options: object) -> RotatedKIVICodec:
    """The rotated KIVI codec of the ``kivi64r-*`` tiers: 64-token blocks, an int8 window by default."""
    return RotatedKIVICodec(64, key_bits=key_bits, value_bits=value_bits, **options)


_CODES, _VIEW = "codes", "materialized"
_UNUSABLE = "truncation, unusable on a real model"
#: side_bits=8 (the keys' zero points stay fp16 under exact_sink: the first key exact)
_S8 = "8-bit scales, int8 zero points (first key exact)"

#: every tier, the default first: (name, attention it is measured with, codec, one-line description)
_TABLE: tuple[tuple[str, str, BlockCodec, str], ...] = (
    # the default: fewer bytes than hqq 4-bit at a far lower KL on the real model
    ("kivi64r-k4v4-w64i8-s8", _CODES, _kivi64r(4, 4, side_bits=8),
     "Hadamard-rotated int4 keys per (64-token block, channel), values per token; 8-bit scales; "
     "newest 64+ int8"),
    # the frontier on the real model: the 8-bit class, 3-bit keys, the fewest bytes
    ("kivi64r-k8v8-w32-s8", _CODES, _kivi64r(8, 8, raw_window=32, window_bits=None, side_bits=8),
     f"kivi64r int8 keys and values, {_S8}; newest 32-95 tokens raw"),
    ("kivi64r-k3v3-w64i8-s8z4", _CODES, _kivi64r(3, 3, side_bits=8, value_zero_bits=4),
     "kivi64r-k4v4-w64i8-s8 with int3 keys and values (8 codes in 3 bytes), 4-bit value zero points"),
    ("kivi64r-k3v2-w0i8-s8z4", _CODES, _kivi64r(3, 2, raw_window=0, side_bits=8, value_zero_bits=4),
     "kivi64r int3 keys, int2 values, 8-bit scales, 4-bit value zero points; only the incomplete block int8"),
    # the reference description's settings: png lossless, jpeg k=8 and k=2 with int8 coefficients,
    # and its default jpeg k=2
    ("png-keep1", _VIEW, PNGCodec(8, keep_ratio=1.0),
     "png, anchor + all deltas (fp64): lossless, but larger than the uncompressed cache (8-byte deltas)"),
    ("jpeg-k8-int8", _CODES, JPEGCodec(8, keep_freqs=8, quant_bits=8),
     "jpeg, all 8 coefficients stored int8 with a scale per (block, frequency)"),
    ("jpeg-k2-int8", _CODES, JPEGCodec(8, keep_freqs=2, quant_bits=8),
     f"jpeg, lowest 2 of 8 coefficients, int8: {_UNUSABLE}"),
    ("jpeg-k2", _VIEW, JPEGCodec(8, keep_freqs=2), f"jpeg, lowest 2 of 8 coefficients: {_UNUSABLE}"),
)  # fmt: skip

#: every tier by name, the default first
TIERS: dict[str, Tier] = make_registry(
    *(Tier(name, description, codec, attention) for name, attention, codec, description in _TABLE)
)


#: the tier a cache gets when it is given no codec and no keyword of the keyword form
DEFAULT_TIER = "kivi64r-k4v4-w64i8-s8"


def default_codec() -> BlockCodec:
    """The codec of :data:`DEFAULT_TIER`."""
    return TIERS[DEFAULT_TIER].codec


def tier_names() -> list[str]:
    """Every tier name, in the registry's order."""
    return list(TIERS)


def tier(name: str, attention: str | None = None, *, registry: Mapping[str, Tier] | None = None) -> Tier:
    """The tier called ``name`` in ``registry`` (default :data:`TIERS`), with ``attention`` when
    given (one of :data:`ATTENTIONS`; None keeps the tier's own). ``KVConfigError`` (a
    ``ValueError``) listing the names otherwise; a name with :data:`RETIRED_ATTENTION_SUFFIX` gets one
    saying to choose the attention instead."""
    tiers = TIERS if registry is None else registry
    if isinstance(name, str) and name in tiers:
        found = tiers[name]
        return found if attention is None else found.with_attention(attention)
    if isinstance(name, str):
        _refuse_attention_suffix(name, "tier")
    raise KVConfigError(f"tier must be one of {list(tiers)}; got {name!r}")
