"""flashcodec for transformers: a ``Cache`` backend and a one-line, per-model hot patch.

    from flashcodec import JPEGCodec, PNGCodec
    from flashcodec.hf import FlashCodecCache, apply_flash_codec, remove_flash_codec
    cache = FlashCodecCache.from_config(model.config, codec=JPEGCodec(keep_freqs=2, quant_bits=8))
    out = model.generate(ids, max_new_tokens=64, cache=cache)

    apply_flash_codec(model, codec=PNGCodec(keep_ratio=1.0))  # every generate() uses a codec cache
    remove_flash_codec(model)                                 # back to exactly what it was

The keyword form (``mode="jpeg", keep_freqs=2, quant_bits=8``) builds the same codec objects.

The only part of flashcodec that imports transformers; needs transformers>=5.0 (the per-layer
``Cache`` API), and says so with an ImportError on older releases.
"""

from .requirements import MIN_TRANSFORMERS, require_layer_api

require_layer_api()

from .attention_choice import attending_on  # noqa: E402
from .cache import CODEC_LAYER_TYPES, FlashCodecCache, config_layer_types  # noqa: E402
from .calibrate import Calibration, calibrate  # noqa: E402
from .codec_attention import apply_codec_attention, remove_codec_attention  # noqa: E402
from .layer import FlashCodecLayer  # noqa: E402
from .patch import FlashCodecPatch, apply_flash_codec, get_flash_codec_patch, remove_flash_codec  # noqa: E402
from .resident import resident_bytes  # noqa: E402
from .sliding_layer import FlashCodecSlidingLayer  # noqa: E402

__all__ = [
    "FlashCodecCache",
    "FlashCodecLayer",
    "FlashCodecSlidingLayer",
    "FlashCodecPatch",
    "Calibration",
    "calibrate",
    "apply_flash_codec",
    "remove_flash_codec",
    "get_flash_codec_patch",
    "apply_codec_attention",
    "remove_codec_attention",
    "attending_on",
    "config_layer_types",
    "resident_bytes",
    "CODEC_LAYER_TYPES",
    "MIN_TRANSFORMERS",
]
