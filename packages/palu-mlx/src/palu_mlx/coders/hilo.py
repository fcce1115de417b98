"""The reference's coder: a rank, then the top channels at ``hi_bit`` and the rest at ``lo_bit``.

:class:`HiLoSplit` is the coder choice (``KVCacheConfig(coder=HiLoSplit(...))``, or any of the
``palu_rank`` / ``palu_energy_threshold`` / ``palu_hi_bit`` / ``palu_lo_bit`` /
``palu_hi_fraction`` fields). Its fit, :func:`fit_mixed_bit`, serves any
:class:`~palu_mlx.mixed_bit.BitAllocationPolicy`: per tensor, a group-head projection, the
policy's segments, and a :class:`~palu_mlx.mixed_bit.MixedBitCoder` (per-group scale and bias per
token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError

from ..lowrank import GroupProjection, fit_group_projection, select_rank
from ..mixed_bit import (
    PACKABLE_BITS,
    UNQUANTIZED_BITS,
    BitAllocationPolicy,
    FixedSplitPolicy,
    MixedBitCoder,
    Segment,
    UniformPolicy,
)
from .base import FitSettings, Fitted, compact_dtype, projection_dtype

__all__ = ["HiLoSplit", "fit_mixed_bit"]


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class HiLoSplit:
    """The reference's latent coder.

    Attributes:
        hi_bit, lo_bit: widths of the top ``hi_fraction`` latent channels (by singular value) and
            of the rest: 1, 2, 3, 4, 5, 6, 8, or 16 (keep unquantized).
        hi_fraction: share in ``[0, 1]`` of the channels at ``hi_bit`` (``ceil(fraction * r)``).

    The rank is the projection's, not the coder's: the config's ``palu_rank``, else the rank
    keeping ``palu_energy_threshold`` (0.90 when unset) of the singular-value energy.
    """

    hi_bit: int = 4
    lo_bit: int = 2
    hi_fraction: float = 0.25

    def __post_init__(self) -> None:
        allowed = (*PACKABLE_BITS, UNQUANTIZED_BITS)
        for name in ("hi_bit", "lo_bit"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
                raise KVConfigError(
                    f"HiLoSplit {name}={value!r} cannot be packed; allowed: {', '.join(map(str, allowed))} "
                    "(16 = keep unquantized)"
                )
        f = self.hi_fraction
        if not _is_real(f) or not math.isfinite(f) or not 0.0 <= f <= 1.0:
            raise KVConfigError(f"HiLoSplit hi_fraction={f!r} must be a number in [0, 1]")

    def policy(self) -> FixedSplitPolicy:
        """The bit allocation: :class:`~palu_mlx.mixed_bit.FixedSplitPolicy` of these widths."""
        return FixedSplitPolicy(self.hi_bit, self.lo_bit, self.hi_fraction)

    def fit(self, keys: mx.array, values: mx.array, settings: FitSettings) -> tuple[Fitted, Fitted]:
        """Keys' and values' projections and coders, fitted on ``keys`` / ``values`` ``[B, H, S, D]``:
        :func:`fit_mixed_bit` with :meth:`policy`."""
        return fit_mixed_bit(keys, values, self.policy(), settings)


def fit_mixed_bit(
    keys: mx.array, values: mx.array, policy: BitAllocationPolicy, settings: FitSettings
) -> tuple[Fitted, Fitted]:
    """Per tensor: a projection of ``settings.groups`` head groups, ``policy``'s segments, a
    MixedBitCoder.

    ``settings.gather`` (tensor parallel, one group per head): this rank's per-group singular
    values -> every group's, so the rank chosen by energy and the policy's allocation are one
    process's.

    Values use ``UniformPolicy(16)`` (unquantized latents) unless ``quantize_values``. Projections
    are cast to :func:`~palu_mlx.coders.base.projection_dtype`.
    """
    value_policy = policy if settings.quantize_values else UniformPolicy(UNQUANTIZED_BITS)
    dtype = settings.dtype
    out = []
    for x, tensor_policy in ((keys, policy), (values, value_policy)):
        projection, segments = _fit_and_allocate(x, tensor_policy, settings)
        coder = MixedBitCoder(segments, settings.group_size, dtype, compact_dtype(dtype))
        out.append((projection.astype(projection_dtype(coder, dtype)), coder))
    return out[0], out[1]


def _fit_and_allocate(
    x: mx.array, policy: BitAllocationPolicy, settings: FitSettings
) -> tuple[GroupProjection, tuple[Segment, ...]]:
    """Fit ``x``'s projection, let ``policy`` allocate widths, and drop trailing 0-bit channels.

    A policy that ``chooses_rank`` (water-filling) sees the full spectrum (or ``rank``
    channels). If it gives every channel 0 bits, channel 0 keeps 1 bit so the coder has a row.
    """
    groups, rank, gather = settings.groups, settings.rank, settings.gather
    if getattr(policy, "chooses_rank", False):
        projection = fit_group_projection(x, groups, rank if rank is not None else x.shape[-1])
    elif rank is None and gather is not None:
        # the energy rank is the smallest over the groups: every rank's groups
        full = fit_group_projection(x, groups, x.shape[-1])
        chosen = select_rank(gather(np.array(full.singular_values)), settings.energy_threshold)
        projection = full.leading(chosen)
    else:
        projection = fit_group_projection(x, groups, rank, settings.energy_threshold)
    spectrum = np.array(projection.singular_values)
    segments = tuple(
        s for s in policy.allocate(spectrum if gather is None else gather(spectrum)) if s.bits > 0
    )
    if not segments:
        segments = (Segment(0, 1, 1),)
    keep = segments[-1].stop
    gaps = any(a.stop != b.start for a, b in zip(segments[:-1], segments[1:], strict=True))
    if segments[0].start != 0 or gaps:
        raise KVConfigError(f"policy {policy!r} gave 0 bits to a channel before a coded one: {segments!r}")
    if keep < projection.rank:
        projection = projection.leading(keep)
    return projection, segments
