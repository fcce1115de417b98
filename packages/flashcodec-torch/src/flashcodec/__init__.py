"""flashcodec: a KV cache that codes the sequence axis like an image.

``JPEGCodec`` (``mode="jpeg"``): block DCT-II along the tokens, keep the lowest ``K`` frequencies
(optionally int8). ``PNGCodec`` (``mode="png"``): per-block anchor + first-order deltas (lossless
tier, optional Top-M pruning). The named tiers are in :mod:`flashcodec.tiers`.

    from flashcodec import CodecKVCache, JPEGCodec
    cache = CodecKVCache(codec=JPEGCodec(block_size=8, keep_freqs=2))
    cache = CodecKVCache(mode="jpeg", block_size=8, keep_freqs=2)   # the same, keyword form
    k, v = cache.forward(k_seq, v_seq)       # full-sequence fill, [B, H, S, D]
    k, v = cache.decode_step(new_k, new_v)   # incremental decode

Importing this package never imports transformers or triton.
"""

from .attention import codec_decode_attention, codec_prefill_attention
from .cache import SUPPORTED_DTYPES, CodecKVCache
from .codecs import CODECS, BlockCodec, JPEGCodec, PNGCodec, dct_matrix, delta_variance_ratio, make_codec
from .storage import CodecStorage
from .stream import CodecStream
from .tiers import TIERS, Tier, tier, tier_names

__version__ = "0.1.0"

# The transformers backend is exported lazily: `import flashcodec` must not import transformers.
_HF_EXPORTS = (
    "FlashCodecCache",
    "FlashCodecLayer",
    "apply_flash_codec",
    "remove_flash_codec",
    "apply_codec_attention",
    "remove_codec_attention",
)


def __getattr__(name: str):
    if name in _HF_EXPORTS:
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HF_EXPORTS))


__all__ = [
    "CodecKVCache",
    "CodecStream",
    "CodecStorage",
    "BlockCodec",
    "JPEGCodec",
    "PNGCodec",
    "make_codec",
    "CODECS",
    "Tier",
    "TIERS",
    "tier",
    "tier_names",
    "dct_matrix",
    "delta_variance_ratio",
    "codec_decode_attention",
    "codec_prefill_attention",
    "SUPPORTED_DTYPES",
    "__version__",
    *_HF_EXPORTS,
]
