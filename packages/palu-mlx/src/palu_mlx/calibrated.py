"""A palu cache layer driven by a calibration file: fixed projections and fixed quantizers.

:class:`CalibratedKVCache` is :class:`~palu_mlx.cache.PaluKVCache` on the projection source
:class:`~palu_mlx.projection_source.FromCalibration`; its own name is what its saved states are
read back by (mlx-lm prompt-cache files, ``from_state``).

With a :class:`~palu_mlx.calibration.Calibration` nothing is fitted at run time: from the first
token, each KV head's keys (pre-RoPE where supported) and values are projected onto the head's
calibrated basis, each latent channel is coded by a fixed uniform scalar quantizer, and the codes
of one token and head are packed into a bitstream of whole bytes (behind one bfloat16 scale per
token and head with ``palu_token_scale``). The first ``palu_sink_tokens`` and newest
``palu_recent_tokens`` tokens are also held exactly (:mod:`palu_mlx.sinks`). The calibration
itself is a per-model constant, reported apart from the per-sequence bytes (``constant_nbytes``),
like the weights.

**Widths.** One reverse water-filling level across every layer, keys and values
(:func:`~palu_mlx.mixed_bit.water_fill` over the head-averaged latent variances) gives each
channel an integer width 0-8 for a budget of ``palu_bits`` code bits per original element;
0-bit channels are dropped, so each tensor's rank follows from the budget.

**Quantizer.** :class:`~palu_mlx.coders.fixed.FixedQuantCoder`: per channel a midrise uniform
quantizer of ``2^b`` levels whose step is the Gaussian-optimal one times the channel's calibrated
standard deviation, optionally stretched per token (``palu_token_scale``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError

from .cache import PaluKVCache
from .calibration.file import Calibration, TensorCalibration
from .coders.fixed import GAUSSIAN_STEP, TOKEN_SCALE_BYTES, FixedQuantCoder, token_scales
from .config import DEFAULT_PALU_BITS, KVCacheConfig
from .lowrank import GroupProjection
from .mixed_bit import water_fill
from .projection_source import CalibratedTensor, FromCalibration
from .rope import Rotary

__all__ = [
    "FixedQuantCoder",
    "CalibratedKVCache",
    "calibrated_caches",
    "GAUSSIAN_STEP",
    "TOKEN_SCALE_BYTES",
    "token_scales",
]


def _tensor_code(t: TensorCalibration, widths: np.ndarray, token_scale: bool = False) -> CalibratedTensor:
    keep = int(np.count_nonzero(widths)) or 1
    widths = tuple(int(w) for w in widths[:keep]) if widths[0] > 0 else (1,)
    sigma = mx.sqrt(mx.maximum(t.variance[:, :keep], 1e-12))
    steps = sigma * mx.array([GAUSSIAN_STEP[w] for w in widths], dtype=mx.float32)
    basis = mx.contiguous(t.basis[:, :, :keep])
    decoder = None if t.decoder is None else mx.contiguous(t.decoder[:, :, :keep])
    projection = GroupProjection(
        basis=basis, mean=t.mean, singular_values=t.variance[:, :keep], decoder=decoder
    )
    return CalibratedTensor(projection, FixedQuantCoder(widths, steps, token_scale))


def allocate_widths(calibration: Calibration, bits: float) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Per layer ``(key widths [D], value widths [Dv])`` from one water-filling level (None: not cached)."""
    tensors, dims = [], 0
    for k, v in zip(calibration.keys, calibration.values, strict=True):
        if k is not None:
            tensors += [np.array(k.variance).mean(axis=0), np.array(v.variance).mean(axis=0)]
            dims += k.basis.shape[1] + v.basis.shape[1]
    widths = iter(water_fill(tensors, int(round(bits * dims))))
    return [None if k is None else (next(widths), next(widths)) for k in calibration.keys]


class CalibratedKVCache(PaluKVCache):
    """One layer's palu cache from a calibration: fixed per-head projections and quantizers.

    A :class:`~palu_mlx.cache.PaluKVCache` whose source is
    :class:`~palu_mlx.projection_source.FromCalibration`: it codes from the first token (no exact
    phase), its state holds the calibration constants first and records the widths, and
    ``nbytes`` leaves the constants out (they are the model's: ``constant_nbytes``).

    Args:
        config: the :class:`KVCacheConfig` (its ``palu_calibration`` and ``palu_bits``).
        key, value: the layer's codes (see :func:`calibrated_caches`).
        rotary: the layer's RoPE when keys were calibrated before RoPE.
    """

    _source_type = FromCalibration

    def __init__(
        self, config: KVCacheConfig, key: CalibratedTensor, value: CalibratedTensor, rotary: Rotary | None
    ):
        self._check_config(config)
        self._setup(config, FromCalibration(key, value), rotary)


def calibrated_caches(
    config: KVCacheConfig,
    calibration: Calibration,
    rotaries: list[Rotary | None] | None,
    heads: slice | None = None,
) -> list[CalibratedKVCache | None]:
    """One :class:`CalibratedKVCache` per calibrated layer (None elsewhere) at ``config.palu_bits``.

    ``rotaries`` must be given (one per layer) when the calibration was made on pre-RoPE keys.
    ``heads`` (tensor parallel: this rank's KV heads of a whole-model file): the widths come from
    the whole file's water-filling level, and each cache holds only these heads' projections and
    steps, so every rank codes its heads as one process does.
    """
    if calibration.pre_rope and not rotaries:
        raise KVConfigError(
            "palu_calibration was fitted on pre-RoPE keys, but this model gets no pre-RoPE path "
            "(palu_pre_rope=False or an unsupported architecture)"
        )
    bits = config.coder_bits if config.coder_bits is not None else DEFAULT_PALU_BITS
    out: list[CalibratedKVCache | None] = []
    for i, widths in enumerate(allocate_widths(calibration, bits)):
        if widths is None:
            out.append(None)
            continue
        key = _tensor_code(_heads(calibration.keys[i], heads), widths[0], config.palu_token_scale)
        value = _tensor_code(_heads(calibration.values[i], heads), widths[1], config.palu_token_scale)
        rotary = rotaries[i] if calibration.pre_rope else None
        out.append(CalibratedKVCache(config, key, value, rotary))
    return out


def _heads(t: TensorCalibration, heads: slice | None) -> TensorCalibration:
    """``t`` cut to the KV heads ``heads`` (all when None)."""
    if heads is None:
        return t
    if heads.stop > t.basis.shape[0]:
        raise KVConfigError(
            f"heads {heads.start}:{heads.stop} exceed the calibration's {t.basis.shape[0]} KV heads"
        )
    cut = {name: mx.contiguous(arr[heads]) for name, arr in t.arrays().items()}
    return TensorCalibration(**cut)
