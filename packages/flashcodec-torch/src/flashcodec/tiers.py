"""The flashcodec tiers: the one place a tier is defined.

A tier is a named codec (r = 8 tokens per block; 64 for the per-channel ``chan64`` tiers) with a one-line description, plus whether
attention runs without the reconstructed view (``materialization_free``: the transformers
backend's :func:`flashcodec.hf.apply_codec_attention`; decode on the stored rows, multi-token
steps over the archive in chunks). :data:`TIERS` lists them easiest first; the
conformance adapter (:mod:`flashcodec.spec`) adds capabilities and tolerances to them, and
command lines, benchmarks and tests read them from here.

    from flashcodec.tiers import TIERS, tier
    cache = CodecKVCache(codec=tier("jpeg-k2-int8").codec)
    cache = FlashCodecCache.from_config(model.config, codec=TIERS["png-keep1"].codec)

A ``-mf`` tier stores exactly what the tier named without the suffix stores (the same codec);
only the attention differs (decode steps on the stored codes, multi-token steps over the archive
in chunks). Adding a tier is one line below.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvspec import KVConfigError

from .codecs import BlockCodec, ChannelInt4Codec, JPEGCodec, KIVICodec, PNGCodec, ZeroPointJPEGCodec

__all__ = ["Tier", "TIERS", "tier"]


@dataclass(frozen=True)
class Tier:
    """One named configuration.

    Attributes:
        name: the tier's name everywhere (results files, command lines, charts, tests).
        description: one line saying what is stored.
        codec: the codec every compressed layer uses.
        materialization_free: decode steps attend on the stored rows and multi-token steps on
            the archive decoded a chunk at a time, instead of the reconstructed K/V view
            (transformers backend only; storage is the codec's either way).
    """

    name: str
    description: str
    codec: BlockCodec
    materialization_free: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip():
            raise KVConfigError(
                f"Tier name must be a non-empty string without outer spaces; got {self.name!r}"
            )
        if not isinstance(self.description, str) or not self.description or "\n" in self.description:
            raise KVConfigError(f"Tier description must be one non-empty line; got {self.description!r}")
        if not isinstance(self.codec, BlockCodec):
            raise KVConfigError(f"Tier codec must be a codec object (a BlockCodec); got {self.codec!r}")
        if not isinstance(self.materialization_free, bool):
            raise KVConfigError(
                f"Tier materialization_free must be a bool; got {self.materialization_free!r}"
            )


def _registry(*tiers: Tier) -> dict[str, Tier]:
    out: dict[str, Tier] = {}
    for t in tiers:
        if t.name in out:
            raise KVConfigError(f"tier name {t.name!r} is defined twice")
        out[t.name] = t
    return out


#: every tier by name, easiest first (each ``-mf`` tier right after the tier it shares a codec with)
TIERS: dict[str, Tier] = _registry(
    Tier(
        "png-keep1",
        "png, anchor + all deltas (fp64): lossless, but larger than the uncompressed cache (8-byte deltas)",
        PNGCodec(8, keep_ratio=1.0),
    ),
    Tier(
        "jpeg-k8",
        "jpeg, all 8 DCT coefficients of each 8-token block (lossless basis, rounding only)",
        JPEGCodec(8, keep_freqs=8),
    ),
    Tier(
        "jpeg-k8-int8",
        "jpeg, all 8 coefficients stored int8 with a scale per (block, frequency)",
        JPEGCodec(8, keep_freqs=8, quant_bits=8),
    ),
    Tier(
        "jpeg-k8-int8-mf",
        "jpeg-k8-int8 with materialization-free attention (decode on the int8 codes, prefill in chunks)",
        JPEGCodec(8, keep_freqs=8, quant_bits=8),
        materialization_free=True,
    ),
    Tier(
        "jpeg-k8-int4",
        "jpeg, all 8 coefficients int4 with a scale per (block, frequency); loses to hqq 4-bit on a real model",
        JPEGCodec(8, keep_freqs=8, quant_bits=4),
    ),
    Tier(
        "jpeg-k8-int4-mf",
        "jpeg-k8-int4 with materialization-free attention (decode on the packed int4 codes, prefill in chunks)",
        JPEGCodec(8, keep_freqs=8, quant_bits=4),
        materialization_free=True,
    ),
    Tier(
        "jpeg-k8-int4z",
        "jpeg, all 8 coefficients int4, fp16 scale and zero per (block, frequency); loses to hqq 4-bit on a real model",
        ZeroPointJPEGCodec(8),
    ),
    Tier(
        "jpeg-k8-int4z-mf",
        "jpeg-k8-int4z with materialization-free attention (decode on the int4 codes, prefill in chunks)",
        ZeroPointJPEGCodec(8),
        materialization_free=True,
    ),
    Tier(
        "jpeg-k8-int4z-w64",
        "jpeg-k8-int4z, the newest 64 to 71 tokens kept raw; loses to hqq 4-bit on a real model",
        ZeroPointJPEGCodec(8, raw_window=64),
    ),
    Tier(
        "jpeg-k8-int4z-w64-mf",
        "jpeg-k8-int4z-w64 with materialization-free attention (decode on the int4 codes and the raw window)",
        ZeroPointJPEGCodec(8, raw_window=64),
        materialization_free=True,
    ),
    Tier(
        "jpeg-k8-int4z-w96i8",
        "jpeg-k8-int4z, the newest 96 to 103 tokens in int8 per token; loses to hqq 4-bit on a real model",
        ZeroPointJPEGCodec(8, raw_window=96, window_bits=8),
    ),
    Tier(
        "jpeg-k8-int4z-w96i8-mf",
        "jpeg-k8-int4z-w96i8 with materialization-free attention (decode on the int4 codes and the int8 window)",
        ZeroPointJPEGCodec(8, raw_window=96, window_bits=8),
        materialization_free=True,
    ),
    Tier(
        "chan64-int4-w64i8",
        "int4 per (64-token block, channel), newest 64-127 tokens int8; kivi64-k4v4-w64i8 beats it at its bytes",
        ChannelInt4Codec(64, raw_window=64, window_bits=8),
    ),
    Tier(
        "chan64-int4-w64i8-mf",
        "chan64-int4-w64i8 with materialization-free attention (decode on the int4 codes and the int8 window)",
        ChannelInt4Codec(64, raw_window=64, window_bits=8),
        materialization_free=True,
    ),
    Tier(
        "kivi64-k8v8-w64i8",
        "int8 keys per (64-token block, channel), int8 values per token, first key exact; newest 64-127 "
        "tokens int8",
        KIVICodec(64, key_bits=8, value_bits=8),
    ),
    Tier(
        "kivi64-k8v8-w64i8-mf",
        "kivi64-k8v8-w64i8 with materialization-free attention (decode on the int8 codes and the int8 window)",
        KIVICodec(64, key_bits=8, value_bits=8),
        materialization_free=True,
    ),
    Tier(
        "kivi64-k4v4-w64i8",
        "int4 keys per (64-token block, channel), int4 values per token (KIVI), first key exact; "
        "newest 64-127 tokens int8",
        KIVICodec(64, key_bits=4, value_bits=4),
    ),
    Tier(
        "kivi64-k4v4-w64i8-mf",
        "kivi64-k4v4-w64i8 with materialization-free attention (decode on the int4 codes and the int8 window)",
        KIVICodec(64, key_bits=4, value_bits=4),
        materialization_free=True,
    ),
    Tier(
        "jpeg-k4",
        "jpeg, lowest 4 of 8 coefficients: truncation, unusable on a real model",
        JPEGCodec(8, keep_freqs=4),
    ),
    Tier(
        "jpeg-k2",
        "jpeg, lowest 2 of 8 coefficients: truncation, unusable on a real model",
        JPEGCodec(8, keep_freqs=2),
    ),
    Tier(
        "jpeg-k2-int8",
        "jpeg, lowest 2 of 8 coefficients, int8: truncation, unusable on a real model",
        JPEGCodec(8, keep_freqs=2, quant_bits=8),
    ),
    Tier(
        "jpeg-k2-int8-mf",
        "jpeg-k2-int8 with materialization-free attention (decode on the int8 codes, prefill in chunks)",
        JPEGCodec(8, keep_freqs=2, quant_bits=8),
        materialization_free=True,
    ),
)


def tier(name: str) -> Tier:
    """The tier called ``name``; ``KVConfigError`` (a ``ValueError``) listing the names otherwise."""
    if not isinstance(name, str) or name not in TIERS:
        raise KVConfigError(f"tier must be one of {list(TIERS)}; got {name!r}")
    return TIERS[name]
