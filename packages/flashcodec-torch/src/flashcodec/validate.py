"""Argument checks shared by the public API: each raises the kvspec error naming the argument,
what it got and what is allowed, and never changes anything.

One place for them, so ``crop``, ``reorder``, ``batch_select_indices`` and the constructors word
the same mistake the same way. A bool is never accepted as a number: ``True`` is an ``int`` in
Python, but ``initial_blocks=True`` or ``repeats=False`` is always a slip.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from kvspec import KVConfigError, KVShapeError, KVSpecError

__all__ = ["all_finite", "batch_index", "check_bool", "check_int"]


def check_int(
    name: str,
    value: object,
    *,
    low: int | None = None,
    high: int | None = None,
    error: type[KVSpecError] = KVConfigError,
) -> int:
    """``value`` as an ``int`` when it is an integer (not a bool) in ``low..high``; ``error`` otherwise."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok and (low is not None and value < low or high is not None and value > high):
        ok = False
    if not ok:
        if low is not None and high is not None:
            allowed = f"an integer in {low}..{high}"
        elif low is not None:
            allowed = f"an integer >= {low}"
        elif high is not None:
            allowed = f"an integer <= {high}"
        else:
            allowed = "an integer"
        raise error(f"{name} must be {allowed}; got {value!r}")
    return int(value)  # type: ignore[arg-type]


def check_bool(name: str, value: object, *, error: type[KVSpecError] = KVConfigError) -> bool:
    """``value`` when it is ``True`` or ``False``; ``error`` for anything else (``1``, ``"no"``, None)."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False; got {value!r}")
    return value


def batch_index(
    name: str,
    indices: object,
    batch: int | None,
    *,
    allow_mask: bool = False,
    device: torch.device | None = None,
) -> torch.Tensor:
    """1-D int64 batch indices in ``0..batch-1`` from ``indices``, as ``DynamicCache`` reads them.

    Accepts a 1-D integer tensor or sequence, with negative entries counted from the end
    (``-1`` is the last row, as tensor indexing does); with ``allow_mask``, also a boolean mask of
    length ``batch``. Raises ``KVShapeError`` naming ``name`` for anything else, for an entry
    outside ``-batch..batch-1`` and for an empty selection (a cache cannot hold a batch of 0).
    ``batch=None`` (nothing stored yet): only the form is checked; the indices come back as given.
    """
    if isinstance(indices, (str, bytes)) or not isinstance(indices, (torch.Tensor, Sequence, range)):
        raise KVShapeError(f"{name} must be a 1-D integer tensor or sequence; got {type(indices).__name__}")
    try:
        idx = torch.as_tensor(indices)
    except (TypeError, ValueError, RuntimeError) as err:
        raise KVShapeError(f"{name} must be a 1-D integer tensor or sequence; got {indices!r:.80}") from err
    if idx.numel() == 0:
        raise KVShapeError(f"{name} must select at least one batch row; got an empty selection")
    if idx.dtype == torch.bool:
        if not allow_mask:
            raise KVShapeError(f"{name} must hold integer indices, not booleans; got {idx.tolist()}")
        if idx.dim() != 1 or batch is not None and idx.numel() != batch:
            raise KVShapeError(
                f"{name} as a boolean mask must have shape [{batch}] (one entry per batch row); "
                f"got shape {tuple(idx.shape)}"
            )
        idx = idx.nonzero().flatten()
    elif idx.dim() != 1 or idx.is_floating_point() or idx.is_complex():
        raise KVShapeError(
            f"{name} must be a 1-D integer tensor or sequence; got shape {tuple(idx.shape)}, {idx.dtype}"
        )
    if idx.numel() == 0:  # a mask that selects nothing
        raise KVShapeError(f"{name} must select at least one batch row; got an empty selection")
    if batch is None:
        return idx.to(dtype=torch.long)
    lo, hi = int(idx.min()), int(idx.max())
    if lo < -batch or hi >= batch:
        raise KVShapeError(
            f"{name} entries must lie in -{batch}..{batch - 1} (batch of {batch}; negative counts from the end); "
            f"got {idx.tolist()}"
        )
    idx = idx.to(dtype=torch.long)
    idx = torch.where(idx < 0, idx + batch, idx)
    return idx if device is None else idx.to(device)


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN / inf. ``aminmax`` propagates NaN and exposes +-inf in one pass;
    on the CPU it is ~8x faster than ``isfinite(t).all()`` (which materializes a bool tensor)."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))
