"""The flashcodec tiers: the one place a storage tier is defined.

A tier is a named codec (r = 8 tokens per block; 64 for the ``chan64`` and ``kivi64`` tiers) with a
one-line description. :data:`TIERS` lists each storage format once, easiest first; the
conformance adapter (:mod:`flashcodec.kvspec_adapter`) adds capabilities and tolerances to them, and
command lines, benchmarks and tests read them from here.

    from flashcodec.tiers import TIERS, tier
    cache = CodecKVCache(codec=tier("jpeg-k2-int8").codec)
    cache = FlashCodecCache.from_config(model.config, codec=TIERS["png-keep1"].codec)

Attention is a second axis, not a second copy of each tier: ``tier("<name>-mf")`` is tier
``<name>`` with ``materialization_free`` set (the transformers backend's
:func:`flashcodec.hf.apply_codec_attention`: decode steps on the stored codes, multi-token steps
over the archive in chunks). It stores exactly what ``<name>`` stores. Every tier takes the
suffix; a tier marked ``offer_mf`` also lists its ``-mf`` name right after its own
(:func:`tier_names`: ``flashcodec compare --list`` and its default selection). Adding a tier is
one row of ``_TABLE`` below.

The KIVI names read ``kivi<r>[r]-k<key bits>v<value bits>-w<window>[i8][-s8[z4]]``: ``r`` a Hadamard
rotation of the channels, ``w`` newest tokens kept out of the blocks (``w0``: only the incomplete
block), ``i8`` those in int8 per token (raw otherwise), ``s8`` 8-bit scales and zero points
(``side_bits=8``), ``z4`` the values' zero points in 4 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvspec import KVConfigError

from .codecs import (
    BlockCodec,
    ChannelInt4Codec,
    JPEGCodec,
    KIVICodec,
    PNGCodec,
    RotatedKIVICodec,
    ZeroPointJPEGCodec,
)

__all__ = ["DEFAULT_TIER", "MF_SUFFIX", "Tier", "TIERS", "default_codec", "tier", "tier_names"]

#: the name suffix that selects materialization-free attention on a tier
MF_SUFFIX = "-mf"


@dataclass(frozen=True)
class Tier:
    """One named configuration.

    Attributes:
        name: the tier's name everywhere (results files, command lines, charts, tests).
        description: one line saying what is stored.
        codec: the codec every compressed layer uses.
        materialization_free: decode steps attend on the stored rows and multi-token steps on
            the archive decoded a chunk at a time, instead of the reconstructed K/V view
            (transformers backend only; storage is the codec's either way). Set by
            :func:`tier` for a ``-mf`` name; the registry's tiers leave it False.
        offer_mf: list the ``-mf`` name beside this tier's (:func:`tier_names`): the pairs
            compare and the benchmarks measure by default.
    """

    name: str
    description: str
    codec: BlockCodec
    materialization_free: bool = False
    offer_mf: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip():
            raise KVConfigError(
                f"Tier name must be a non-empty string without outer spaces; got {self.name!r}"
            )
        if not isinstance(self.description, str) or not self.description or "\n" in self.description:
            raise KVConfigError(f"Tier description must be one non-empty line; got {self.description!r}")
        if not isinstance(self.codec, BlockCodec):
            raise KVConfigError(f"Tier codec must be a codec object (a BlockCodec); got {self.codec!r}")
        for flag in ("materialization_free", "offer_mf"):
            if not isinstance(getattr(self, flag), bool):
                raise KVConfigError(f"Tier {flag} must be a bool; got {getattr(self, flag)!r}")

    def with_materialization_free(self) -> Tier:
        """This tier with materialization-free attention: named ``<name>-mf``, the same codec."""
        if self.materialization_free:
            return self
        return Tier(
            self.name + MF_SUFFIX,
            f"{self.name} with materialization-free attention (decode on the stored codes, prefill in chunks)",
            self.codec,
            materialization_free=True,
        )


def _registry(*tiers: Tier) -> dict[str, Tier]:
    out: dict[str, Tier] = {}
    for t in tiers:
        if t.name in out:
            raise KVConfigError(f"tier name {t.name!r} is defined twice")
        if t.name.endswith(MF_SUFFIX) or t.materialization_free:
            raise KVConfigError(
                f"tier {t.name!r}: the registry holds storage tiers; {MF_SUFFIX!r} is the attention axis"
            )
        out[t.name] = t
    return out


def _kivi64r(key_bits: int, value_bits: int, **options: object) -> RotatedKIVICodec:
    """The rotated KIVI codec of the ``kivi64r-*`` tiers: 64-token blocks, an int8 window by default."""
    return RotatedKIVICodec(64, key_bits=key_bits, value_bits=value_bits, **options)


_MF, _PLAIN = True, False
_UNUSABLE = "truncation, unusable on a real model"
_LOSES = "loses to hqq 4-bit on a real model"
#: side_bits=8 (the keys' zero points stay fp16 under exact_sink: the first key exact)
_S8 = "8-bit scales, int8 zero points (first key exact)"

#: every storage tier, easiest first: (name, offer ``-mf``, codec, one-line description)
_TABLE: tuple[tuple[str, bool, BlockCodec, str], ...] = (
    ("png-keep1", _PLAIN, PNGCodec(8, keep_ratio=1.0),
     "png, anchor + all deltas (fp64): lossless, but larger than the uncompressed cache (8-byte deltas)"),
    ("jpeg-k8", _PLAIN, JPEGCodec(8, keep_freqs=8),
     "jpeg, all 8 DCT coefficients of each 8-token block (lossless basis, rounding only)"),
    ("jpeg-k8-int8", _MF, JPEGCodec(8, keep_freqs=8, quant_bits=8),
     "jpeg, all 8 coefficients stored int8 with a scale per (block, frequency)"),
    ("jpeg-k8-int4", _MF, JPEGCodec(8, keep_freqs=8, quant_bits=4),
     f"jpeg, all 8 coefficients int4 with a scale per (block, frequency); {_LOSES}"),
    ("jpeg-k8-int4z", _MF, ZeroPointJPEGCodec(8),
     f"jpeg, all 8 coefficients int4, fp16 scale and zero per (block, frequency); {_LOSES}"),
    ("jpeg-k8-int4z-w64", _MF, ZeroPointJPEGCodec(8, raw_window=64),
     f"jpeg-k8-int4z, the newest 64 to 71 tokens kept raw; {_LOSES}"),
    ("jpeg-k8-int4z-w96i8", _MF, ZeroPointJPEGCodec(8, raw_window=96, window_bits=8),
     f"jpeg-k8-int4z, the newest 96 to 103 tokens in int8 per token; {_LOSES}"),
    ("chan64-int4-w64i8", _MF, ChannelInt4Codec(64, raw_window=64, window_bits=8),
     "int4 per (64-token block, channel), newest 64-127 tokens int8; kivi64-k4v4-w64i8 beats it at its bytes"),
    ("kivi64-k8v8-w64i8", _MF, KIVICodec(64, key_bits=8, value_bits=8),
     "int8 keys per (64-token block, channel), int8 values per token, first key exact; newest 64-127 "
     "tokens int8"),
    ("kivi64-k4v4-w64i8", _MF, KIVICodec(64, key_bits=4, value_bits=4),
     "int4 keys per (64-token block, channel), int4 values per token (KIVI), first key exact; "
     "newest 64-127 tokens int8"),
    ("kivi64r-k4v4-w64i8", _MF, _kivi64r(4, 4),
     "kivi64-k4v4-w64i8 after a seeded Hadamard rotation of each head's key and value channels"),
    ("kivi64r-k3v3-w64i8", _MF, _kivi64r(3, 3),
     "kivi64r-k4v4-w64i8 with int3 keys and int3 values (eight codes in three bytes)"),
    ("kivi64r-k3v2-w64i8", _MF, _kivi64r(3, 2),
     "kivi64r-k4v4-w64i8 with int3 keys and int2 values (packed)"),
    ("kivi64r-k4v4-w64i8-s8", _MF, _kivi64r(4, 4, side_bits=8),
     f"kivi64r-k4v4-w64i8, {_S8}"),
    ("kivi64r-k3v3-w64i8-s8z4", _MF, _kivi64r(3, 3, side_bits=8, value_zero_bits=4),
     "kivi64r-k3v3-w64i8, 8-bit scales, 4-bit value zero points (first key exact)"),
    ("kivi64r-k3v2-w64i8-s8z4", _MF, _kivi64r(3, 2, side_bits=8, value_zero_bits=4),
     "kivi64r-k3v2-w64i8, 8-bit scales, 4-bit value zero points (first key exact)"),
    ("kivi64r-k8v8-w32-s8", _MF, _kivi64r(8, 8, raw_window=32, window_bits=None, side_bits=8),
     f"kivi64r int8 keys and values, {_S8}; newest 32-95 tokens raw"),
    ("kivi64r-k3v3-w0i8-s8", _MF, _kivi64r(3, 3, raw_window=0, side_bits=8),
     f"kivi64r-k3v3-w64i8, {_S8}; only the incomplete block int8"),
    ("kivi64r-k3v2-w0i8-s8z4", _MF, _kivi64r(3, 2, raw_window=0, side_bits=8, value_zero_bits=4),
     "kivi64r-k3v2-w64i8, 8-bit scales, 4-bit value zero points (first key exact); only the incomplete block int8"),
    ("kivi64r-k3v2-w0i8-s8z4-vs1", _MF,
     _kivi64r(3, 2, raw_window=0, side_bits=8, value_zero_bits=4, value_sink_tokens=1),
     "kivi64r-k3v2-w0i8-s8z4, the first token's value kept in int8 (a value sink beside the exact first key)"),
    ("jpeg-k4", _PLAIN, JPEGCodec(8, keep_freqs=4), f"jpeg, lowest 4 of 8 coefficients: {_UNUSABLE}"),
    ("jpeg-k2", _PLAIN, JPEGCodec(8, keep_freqs=2), f"jpeg, lowest 2 of 8 coefficients: {_UNUSABLE}"),
    ("jpeg-k2-int8", _MF, JPEGCodec(8, keep_freqs=2, quant_bits=8),
     f"jpeg, lowest 2 of 8 coefficients, int8: {_UNUSABLE}"),
)  # fmt: skip

#: every storage tier by name, easiest first (``offer_mf``: its ``-mf`` name is listed beside it)
TIERS: dict[str, Tier] = _registry(
    *(Tier(name, description, codec, offer_mf=mf) for name, mf, codec, description in _TABLE)
)


#: the tier a cache gets when it is given no codec and no keyword of the keyword form
DEFAULT_TIER = "kivi64r-k4v4-w64i8-s8"


def default_codec() -> BlockCodec:
    """The codec of :data:`DEFAULT_TIER`."""
    return TIERS[DEFAULT_TIER].codec


def tier_names() -> list[str]:
    """Every tier name a command line lists, in order: each tier of :data:`TIERS`, followed by its
    ``-mf`` name when it has ``offer_mf``."""
    return [n for t in TIERS.values() for n in (t.name, t.name + MF_SUFFIX)[: 2 if t.offer_mf else 1]]


def tier(name: str) -> Tier:
    """The tier called ``name``: a tier of :data:`TIERS`, or ``<tier>-mf`` for that tier with
    materialization-free attention. ``KVConfigError`` (a ``ValueError``) listing the names otherwise."""
    if isinstance(name, str):
        if name in TIERS:
            return TIERS[name]
        base = name.removesuffix(MF_SUFFIX)
        if base != name and base in TIERS:
            return TIERS[base].with_materialization_free()
    raise KVConfigError(
        f"tier must be one of {tier_names()} (any tier also with the suffix {MF_SUFFIX!r}); got {name!r}"
    )
