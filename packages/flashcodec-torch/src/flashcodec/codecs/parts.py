"""A codec's stored arrays: how each is named and shaped, and the check every float part passes.

Its own module because both the block codecs (:mod:`.base`) and the tail coders of the raw
window (:mod:`.tail`) describe their arrays with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvspec import KVDataError

__all__ = ["PartSpec", "check_finite_part"]


@dataclass(frozen=True)
class PartSpec:
    """One stored array of a codec: its name, per-block shape and dtype.

    The stored tensor for ``n`` blocks has shape ``[..., n, *shape]``.
    ``dtype=None`` means "the input dtype".
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None


def check_finite_part(spec: PartSpec, part: torch.Tensor, *, check_finite: bool) -> None:
    """``KVDataError`` when a float part holds NaN / inf (scales always; any other part when
    ``check_finite``: with it off, an infinite input leaves infinite coefficients), or a negative
    scale (a part named ``scales`` / ``tail_scales`` / ``sink_scales``: a range over levels, never below 0)."""
    if not part.is_floating_point():
        return
    is_scale = spec.name in ("scales", "tail_scales", "sink_scales")
    if (check_finite or is_scale) and not _all_finite(part):
        raise KVDataError(f"part {spec.name!r} holds NaN or infinity")
    if is_scale and bool((part < 0).any()):
        raise KVDataError(f"part {spec.name!r} holds a negative scale (scales are a range over levels, >= 0)")


def _all_finite(t: torch.Tensor) -> bool:
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))
