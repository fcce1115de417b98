"""A bit budget: water-filled widths per latent channel, coded by fixed Gaussian-step quantizers.

:class:`WaterFilling` is the coder choice (``KVCacheConfig(coder=WaterFilling(bits=2.5))``, or
``palu_bits``; the default). Fitted at the prefill, each tensor gets a full-rank (or
``palu_rank``) projection per head group; one reverse water-filling level across the layer's keys
and values (:func:`~palu_mlx.mixed_bit.water_fill` on the head-averaged latent variances) gives
each channel an integer width 0-8 for ``bits`` code bits per element; 0-bit channels are dropped;
each head's channel gets a fixed quantizer whose step is set by its variance over the fit tokens
(:class:`~palu_mlx.coders.fixed.FixedQuantCoder`), optionally with a per-token scale. With a
calibration file the same choice sets the calibrated cache's budget
(:mod:`palu_mlx.calibrated`). By default (``relative=None``) the level weighs each tensor's
relative error (:attr:`WaterFilling.relative_error`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError

from ..lowrank import GroupProjection, fit_group_projection, project
from ..mixed_bit import WaterFillingPolicy, water_fill
from .base import FitSettings, Fitted, compact_dtype
from .fixed import GAUSSIAN_STEP, FixedQuantCoder
from .hilo import fit_mixed_bit

__all__ = ["WaterFilling", "DEFAULT_PALU_BITS", "fit_variances", "fixed_coder"]

#: code bits per element of a config that names neither ``palu_bits`` nor the hi/lo split: the
#: smallest tier that needs no file (``palu-2.25bit-scaled+rel``: water-filling weighed by relative
#: error at the prefill, per-token scales, the first and the newest tokens exact) whose KL to the
#: uncompressed model is at most mlx-lm's ``QuantizedKVCache(bits=4)``'s on the real model,
#: SmolLM2-135M-Instruct, at 2,048 tokens of context (``benchmarks/results/palu_real_model.json``;
#: see docs/palu-mlx.md).
DEFAULT_PALU_BITS = 2.25


def is_bit_budget(bits: Any) -> bool:
    """Whether ``bits`` is an average code-bit budget the coder takes: a finite number in (0, 8]."""
    return (
        isinstance(bits, (int, float))
        and not isinstance(bits, bool)
        and math.isfinite(bits)
        and 0 < bits <= 8
    )


def is_weight(weight: Any) -> bool:
    """Whether ``weight`` is a water-filling weight the coder takes: a finite number > 0."""
    return (
        isinstance(weight, (int, float))
        and not isinstance(weight, bool)
        and math.isfinite(weight)
        and weight > 0
    )


@dataclass(frozen=True, eq=False)
class WaterFilling:
    """The bit-budget latent coder.

    Attributes:
        bits: code bits per original K/V element, a number in ``(0, 8]``.
        token_scale: store one bfloat16 scale per token and head so that no channel of 2 bits or
            more clips (:func:`~palu_mlx.coders.fixed.token_scales`); False: fixed ranges only.
        key_weight, value_weight: what a unit of squared error in a key (value) channel costs, a
            positive number: the water-filling level runs over the channel variances times these,
            so the tensor whose error moves the model's output more gets more of the layer's bits
            (:mod:`palu_mlx.budgets` sets them from a model's measured sensitivity). 1 and 1: keys
            and values alike.
        relative: each tensor's channel variances are also divided by the tensor's total variance
            (over its channels, averaged over the heads) before the level is set, so the level
            weighs relative error, ``|Δx|² / E|x - μ|²``: a tensor of small magnitude (a real model's
            values in its first layers, its keys in its last) is not starved of bits for being
            small. The cache computes it at the prefill; nothing is measured beforehand. On
            SmolLM2-135M the KL per unit of relative error varies far less across layers and
            between keys and values than the KL per unit of squared error
            (``benchmarks/results/palu_sensitivity.json``). None (the default) is automatic:
            relative error unless ``key_weight`` / ``value_weight`` set weights of their own
            (:attr:`relative_error` reads the choice). A :class:`~palu_mlx.config.KVCacheConfig`
            applies the same rule and also turns it off where a calibration file or a sensitivity
            profile sets the widths. Two coders are equal when they code alike: ``None`` equals
            the value it resolves to.
    """

    bits: float = DEFAULT_PALU_BITS
    token_scale: bool = True
    key_weight: float = 1.0
    value_weight: float = 1.0
    relative: bool | None = None

    def __post_init__(self) -> None:
        if not is_bit_budget(self.bits):
            raise KVConfigError(
                f"WaterFilling bits={self.bits!r} must be a number in (0, 8] (code bits per element)"
            )
        if not isinstance(self.token_scale, bool):
            raise KVConfigError(f"WaterFilling token_scale={self.token_scale!r} must be True or False")
        for name in ("key_weight", "value_weight"):
            w = getattr(self, name)
            if not is_weight(w):
                raise KVConfigError(f"WaterFilling {name}={w!r} must be a finite number > 0")
        if self.relative is not None and not isinstance(self.relative, bool):
            raise KVConfigError(
                f"WaterFilling relative={self.relative!r} must be None (automatic), True or False"
            )

    @property
    def relative_error(self) -> bool:
        """Whether the level weighs relative error: :attr:`relative`, or when it is None (automatic)
        True unless ``key_weight`` / ``value_weight`` are weights of their own (not 1 and 1)."""
        if self.relative is not None:
            return self.relative
        return (self.key_weight, self.value_weight) == (1.0, 1.0)

    def _coding(self) -> tuple:
        return (self.bits, self.token_scale, self.key_weight, self.value_weight, self.relative_error)

    # equal when they code alike: relative=None is the same coder as the value it resolves to
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WaterFilling):
            return NotImplemented
        return self._coding() == other._coding()

    def __hash__(self) -> int:
        return hash(self._coding())

    def policy(self) -> WaterFillingPolicy:
        """The same budget as a mixed-bit allocation policy (water-filled segments, per-group scales)."""
        return WaterFillingPolicy(self.bits)

    def fit(self, keys: mx.array, values: mx.array, settings: FitSettings) -> tuple[Fitted, Fitted]:
        """Keys' and values' projections and coders, fitted on ``keys`` / ``values`` ``[B, H, S, D]``
        (``settings.rank`` caps the full rank). Under tensor parallel (``settings.gather``) the
        widths are decided on every head's statistics, so each rank codes its heads as one process
        would.

        With ``quantize_values`` False the values stay unquantized latents (rank by
        ``energy_threshold`` unless ``rank``), and a mixed-bit coder with water-filled segments
        (:meth:`policy`, per-group scales of ``group_size`` channels) codes the keys.
        """
        if not settings.quantize_values:
            return fit_mixed_bit(keys, values, self.policy(), settings)
        fitted = [fit_variances(x, settings.groups, settings.rank) for x in (keys, values)]
        dims = keys.shape[-1] + values.shape[-1]
        # the level is decided on every head's variances (all ranks' under tensor parallel)
        every = [v if settings.gather is None else settings.gather(v) for _, v in fitted]
        weights = [self.key_weight, self.value_weight]
        if self.relative_error:
            weights = [
                w / max(float(v.mean(axis=0).sum()), 1e-30) for w, v in zip(weights, every, strict=True)
            ]
        widths = water_fill(
            [w * v.mean(axis=0) for w, v in zip(weights, every, strict=True)], self.budget(dims)
        )
        out = [
            fixed_coder(proj, head_var, w, all_var, self.token_scale, settings.dtype)
            for (proj, head_var), w, all_var in zip(fitted, widths, every, strict=True)
        ]
        return out[0], out[1]

    def budget(self, dims: int) -> int:
        """Code bits per token and head for keys and values of ``dims`` channels together."""
        return int(round(self.bits * dims))


def fit_variances(x: mx.array, groups: int, rank: int | None) -> tuple[GroupProjection, np.ndarray]:
    """A full-rank (or ``rank``) projection of ``x [B, H, S, D]`` per head group, and each head's
    latent channel variances ``[H, r]`` (float64) over the fit tokens."""
    full = x.shape[-1] if rank is None else min(rank, x.shape[-1])
    proj = fit_group_projection(x, groups, full)
    latents = project(x, proj)
    head_var = mx.mean(latents * latents, axis=(0, 2))  # [H, r]; latents are centred per group
    return proj, np.array(head_var, dtype=np.float64)


def fixed_coder(
    proj: GroupProjection,
    head_var: np.ndarray,
    widths: np.ndarray,
    all_var: np.ndarray,
    token_scale: bool,
    dtype: mx.Dtype,
) -> Fitted:
    """The projection cut to the channels ``widths`` keeps and their fixed quantizers.

    ``widths [r]`` are the bits of each channel in the projection's order (0 drops it);
    ``head_var [H, r]`` sets each head's steps; ``all_var`` (every head's variances, [H', r])
    orders the kept channels so that the widths are non-increasing and 0-bit ones trail.
    """
    order = np.argsort(-all_var.mean(axis=0), kind="stable")
    w = np.asarray(widths)[order]
    keep = max(1, int(np.count_nonzero(w)))
    cols = mx.array(order[:keep].astype(np.int32))
    widths_kept = tuple(max(1, int(b)) for b in w[:keep])
    sigma = np.sqrt(np.maximum(head_var[:, order[:keep]], 1e-12))
    steps = mx.array((sigma * np.array([GAUSSIAN_STEP[b] for b in widths_kept])).astype(np.float32))
    proj = GroupProjection(
        basis=mx.contiguous(mx.take(proj.basis, cols, axis=2)),
        mean=proj.mean,
        singular_values=mx.contiguous(mx.take(proj.singular_values, cols, axis=1)),
    )
    return proj.astype(compact_dtype(dtype)), FixedQuantCoder(widths_kept, steps, token_scale)
