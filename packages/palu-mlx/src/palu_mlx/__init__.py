"""palu-mlx: a low-rank latent KV cache for mlx-lm.

Keys and values of each layer are projected onto group-head low-rank bases
fitted on the first tokens (PALU-style group-head SVD) or read from a calibration
file, coded by the config's coder (:mod:`palu_mlx.coders`: a bit budget by default), and attended on as codes (:mod:`palu_mlx.attention`). Named configurations
(tiers) are in :data:`TIERS`::

    from palu_mlx import KVCacheConfig, KVCacheBuilder

    config = KVCacheConfig(method="palu", head_dim=64)
    caches = KVCacheBuilder.for_model(model, config)
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=caches)
"""

from .attention import latent_attention
from .baseline import NaiveQuantKVCache, naive_roundtrip
from .builder import (
    KVCacheBuilder,
    load_prompt_cache,
    model_kv_dims,
    register_with_mlx_lm,
    save_prompt_cache,
)
from .cache import PaluKVCache
from .calibrated import CalibratedKVCache, FixedQuantCoder
from .calibration import (
    Calibration,
    TensorCalibration,
    calibrate,
    default_calibration_text,
)
from .coders import HiLoSplit, LatentCoder, WaterFilling
from .config import KVCacheConfig
from .lowrank import GroupProjection, fit_group_projection, project, reconstruct, select_rank
from .mixed_bit import (
    BitAllocationPolicy,
    FixedSplitPolicy,
    MixedBitCoder,
    Segment,
    UniformPolicy,
    WaterFillingPolicy,
    water_fill,
)
from .rope import PRE_ROPE_ARCHITECTURES, PreRopeFallbackWarning, Rotary, model_rotaries
from .rotating import RotatingPaluKVCache
from .tiers import CALIBRATED_TIERS, TIERS, Tier, tier

__version__ = "0.1.0"

__all__ = [
    "KVCacheConfig",
    "WaterFilling",
    "HiLoSplit",
    "LatentCoder",
    "KVCacheBuilder",
    "PaluKVCache",
    "CalibratedKVCache",
    "RotatingPaluKVCache",
    "FixedQuantCoder",
    "Calibration",
    "TensorCalibration",
    "calibrate",
    "default_calibration_text",
    "NaiveQuantKVCache",
    "naive_roundtrip",
    "Tier",
    "TIERS",
    "CALIBRATED_TIERS",
    "tier",
    "save_prompt_cache",
    "load_prompt_cache",
    "register_with_mlx_lm",
    "model_kv_dims",
    "GroupProjection",
    "fit_group_projection",
    "project",
    "reconstruct",
    "select_rank",
    "BitAllocationPolicy",
    "FixedSplitPolicy",
    "UniformPolicy",
    "MixedBitCoder",
    "Segment",
    "WaterFillingPolicy",
    "water_fill",
    "Rotary",
    "PreRopeFallbackWarning",
    "PRE_ROPE_ARCHITECTURES",
    "model_rotaries",
    "latent_attention",
]
