"""flashcodec configurations measured by studies, outside the package's registry.

:data:`flashcodec.tiers.TIERS` holds the tiers a user should pick from. The configurations here
lost to one of them on the real model, or were steps towards them; the benchmark scripts that
measured them (``benchmarks/flashcodec/*.py``) look their names up here, so their results files
can be reproduced. Each row is a :class:`flashcodec.tiers.Tier` with the attention it was
measured with; adding one is one row of ``_TABLE``. Run as a script, this file is ``flashcodec
compare`` offering these configurations beside the package's tiers:

    hatch run bench:python benchmarks/studies/flashcodec_tiers.py --tiers kivi64-k4v4-w64i8,kivi64r-k4v4-w64i8-s8
"""

from __future__ import annotations

import sys

from flashcodec.codecs import (
    BlockCodec,
    ChannelInt4Codec,
    JPEGCodec,
    KIVICodec,
    RotatedKIVICodec,
    ZeroPointJPEGCodec,
)
from flashcodec.tiers import TIERS, Tier, make_registry
from flashcodec.tiers import tier as registry_tier

__all__ = ["STUDY_TIERS", "ALL_TIERS", "study_tier"]


def _kivi64r(key_bits: int, value_bits: int, **options: object) -> RotatedKIVICodec:
    return RotatedKIVICodec(64, key_bits=key_bits, value_bits=value_bits, **options)


_CODES, _VIEW = "codes", "materialized"
_UNUSABLE = "truncation, unusable on a real model"
_LOSES = "loses to hqq 4-bit on a real model"
_S8 = "8-bit scales, int8 zero points (first key exact)"

#: (name, attention it was measured with, codec, one-line description)
_TABLE: tuple[tuple[str, str, BlockCodec, str], ...] = (
    ("jpeg-k8", _VIEW, JPEGCodec(8, keep_freqs=8),
     "jpeg, all 8 DCT coefficients of each 8-token block (lossless basis, rounding only)"),
    ("jpeg-k8-int4", _CODES, JPEGCodec(8, keep_freqs=8, quant_bits=4),
     f"jpeg, all 8 coefficients int4 with a scale per (block, frequency); {_LOSES}"),
    ("jpeg-k8-int4z", _CODES, ZeroPointJPEGCodec(8),
     f"jpeg, all 8 coefficients int4, fp16 scale and zero per (block, frequency); {_LOSES}"),
    ("jpeg-k8-int4z-w64", _CODES, ZeroPointJPEGCodec(8, raw_window=64),
     f"jpeg-k8-int4z, the newest 64 to 71 tokens kept raw; {_LOSES}"),
    ("jpeg-k8-int4z-w96i8", _CODES, ZeroPointJPEGCodec(8, raw_window=96, window_bits=8),
     f"jpeg-k8-int4z, the newest 96 to 103 tokens in int8 per token; {_LOSES}"),
    ("chan64-int4-w64i8", _CODES, ChannelInt4Codec(64, raw_window=64, window_bits=8),
     "int4 per (64-token block, channel), newest 64-127 tokens int8; kivi64-k4v4-w64i8 beats it at its bytes"),
    ("kivi64-k8v8-w64i8", _CODES, KIVICodec(64, key_bits=8, value_bits=8),
     "int8 keys per (64-token block, channel), int8 values per token, first key exact; newest 64-127 "
     "tokens int8"),
    ("kivi64-k4v4-w64i8", _CODES, KIVICodec(64, key_bits=4, value_bits=4),
     "int4 keys per (64-token block, channel), int4 values per token (KIVI), first key exact; "
     "newest 64-127 tokens int8"),
    ("kivi64r-k4v4-w64i8", _CODES, _kivi64r(4, 4),
     "kivi64-k4v4-w64i8 after a seeded Hadamard rotation of each head's key and value channels"),
    ("kivi64r-k3v3-w64i8", _CODES, _kivi64r(3, 3),
     "kivi64r-k4v4-w64i8 with int3 keys and int3 values (eight codes in three bytes)"),
    ("kivi64r-k3v2-w64i8", _CODES, _kivi64r(3, 2),
     "kivi64r-k4v4-w64i8 with int3 keys and int2 values (packed)"),
    ("kivi64r-k3v2-w64i8-s8z4", _CODES, _kivi64r(3, 2, side_bits=8, value_zero_bits=4),
     "kivi64r-k3v2-w64i8, 8-bit scales, 4-bit value zero points (first key exact)"),
    ("kivi64r-k3v3-w0i8-s8", _CODES, _kivi64r(3, 3, raw_window=0, side_bits=8),
     f"kivi64r-k3v3-w64i8, {_S8}; only the incomplete block int8"),
    ("kivi64r-k4v4-w64i8-s8-vs1", _CODES, _kivi64r(4, 4, side_bits=8, value_sink_tokens=1),
     "kivi64r-k4v4-w64i8-s8, the first token's value kept in int8 (a value sink beside the exact first key)"),
    ("kivi64r-k3v2-w0i8-s8z4-vs1", _CODES,
     _kivi64r(3, 2, raw_window=0, side_bits=8, value_zero_bits=4, value_sink_tokens=1),
     "kivi64r-k3v2-w0i8-s8z4, the first token's value kept in int8 (a value sink beside the exact first key)"),
    ("jpeg-k4", _VIEW, JPEGCodec(8, keep_freqs=4), f"jpeg, lowest 4 of 8 coefficients: {_UNUSABLE}"),
)  # fmt: skip

#: the study configurations by name
STUDY_TIERS: dict[str, Tier] = make_registry(
    *(Tier(name, description, codec, attention) for name, attention, codec, description in _TABLE)
)

#: the package's tiers, then the study configurations (a name is defined once across the two)
ALL_TIERS: dict[str, Tier] = make_registry(*TIERS.values(), *STUDY_TIERS.values())


def study_tier(name: str, attention: str | None = None) -> Tier:
    """The tier or study configuration called ``name`` (:func:`flashcodec.tiers.tier` over
    :data:`ALL_TIERS`), with ``attention`` when given."""
    return registry_tier(name, attention, registry=ALL_TIERS)


if __name__ == "__main__":
    from flashcodec.compare import main

    sys.exit(main(sys.argv[1:], registry=ALL_TIERS))
