"""The cache-layer contract both implementation packages meet.

Framework-neutral: arrays are whatever the backend uses (``mlx.core.array``,
``torch.Tensor``, ``numpy.ndarray``); only their ``.shape`` and ``.dtype`` are
read here. The shape convention everywhere is ``[B, H, S, D]``:
batch, key/value heads, sequence (tokens), head dimension.

Modelled on mlx-lm's cache classes (``update_and_fetch``, ``offset``,
``state`` / ``meta_state``, ``trim``, ``nbytes``, ``empty``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "KVSpecError",
    "KVConfigError",
    "KVShapeError",
    "KVDtypeError",
    "KVValueError",
    "KVTrimError",
    "KVCacheLayer",
    "KVDataError",
    "StorageStats",
    "check_kv_pair",
    "trim_count",
]


# --------------------------------------------------------------------------- errors
class KVSpecError(Exception):
    """Base of every error a user of a kvspec cache can cause.

    Concrete errors also subclass ``ValueError`` or ``TypeError`` so callers
    that only know the builtins still catch them.
    """


class KVConfigError(KVSpecError, ValueError):
    """A configuration value is out of range (the message names it and the allowed range)."""


class KVShapeError(KVSpecError, ValueError):
    """Keys/values have the wrong rank, mismatched shapes, or B/H/D changed mid-stream."""


class KVDtypeError(KVSpecError, TypeError):
    """Keys/values have a dtype the cache does not accept, or K and V dtypes differ."""


class KVValueError(KVSpecError, ValueError):
    """Keys/values contain values the cache rejects (NaN or infinity)."""


class KVTrimError(KVSpecError, ValueError):
    """``trim(n)`` was asked for a negative count, or the cache cannot trim."""


class KVDataError(KVSpecError, ValueError):
    """A file or saved state the library reads is missing, corrupt or inconsistent with its
    metadata (the message names the file or field and what is wrong)."""


# --------------------------------------------------------------------------- protocol
@runtime_checkable
class KVCacheLayer(Protocol):
    """One attention layer's key/value cache.

    Every method that takes keys/values expects arrays of shape ``[B, H, S, D]``
    (values may have their own last dimension ``Dv``). A call that raises leaves
    the cache exactly as it was.
    """

    @property
    def offset(self) -> int:
        """Number of tokens held so far (the sequence length ``S_total``)."""
        ...

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Append ``keys [B, H, S, D]`` and ``values [B, H, S, Dv]``.

        Returns the full keys ``[B, H, S_total, D]`` and values
        ``[B, H, S_total, Dv]`` so far, in the dtype of the input.
        """
        ...

    @property
    def nbytes(self) -> int:
        """Bytes actually held, summed from the ``.nbytes`` of every array the cache keeps."""
        ...

    @property
    def raw_nbytes(self) -> int:
        """Bytes an uncompressed cache of the same dtype would hold for the same tokens."""
        ...

    def is_trimmable(self) -> bool:
        """Whether ``trim`` is supported."""
        ...

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (clamped to ``offset``); returns how many were dropped."""
        ...

    @property
    def state(self) -> Any:
        """The arrays needed to rebuild the cache (a tuple/list/dict of arrays)."""
        ...

    @property
    def meta_state(self) -> Any:
        """Plain-string metadata needed beside ``state`` to rebuild the cache."""
        ...

    def empty(self) -> bool:
        """True when no token has been added yet."""
        ...


# --------------------------------------------------------------------------- stats
@dataclass(frozen=True)
class StorageStats:
    """Measured storage of a cache: bytes held vs the uncompressed equivalent.

    ``elements`` is the number of K and V scalars the cache represents
    (``B*H*S*(D+Dv)``), so ``bits_per_element`` is an effective rate from measured bytes.
    """

    tokens: int
    nbytes: int
    raw_nbytes: int
    elements: int

    def __post_init__(self) -> None:
        for name in ("tokens", "nbytes", "raw_nbytes", "elements"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise KVConfigError(f"StorageStats {name} must be an int >= 0; got {value!r}")

    @property
    def ratio(self) -> float:
        """``nbytes / raw_nbytes`` (below 1 means the cache saves memory)."""
        return self.nbytes / self.raw_nbytes if self.raw_nbytes else float("nan")

    @property
    def bits_per_element(self) -> float:
        """Effective bits per K or V element: ``8 * nbytes / elements``."""
        return 8.0 * self.nbytes / self.elements if self.elements else float("nan")


# --------------------------------------------------------------------------- validation
def check_kv_pair(
    keys_shape: tuple[int, ...],
    values_shape: tuple[int, ...],
    keys_dtype: Any,
    values_dtype: Any,
    expected: tuple[int, int, int, int] | None = None,
) -> tuple[int, int, int, int, int]:
    """Validate one ``update_and_fetch`` call's shapes; raise the spec error on mismatch.

    ``expected`` is ``(B, H, D, Dv)`` fixed by earlier calls, or None on the first call.
    Returns ``(B, H, S, D, Dv)``. Works on shapes only, so every backend shares it.
    """
    keys_shape, values_shape = tuple(keys_shape), tuple(values_shape)
    for label, shape in (("keys", keys_shape), ("values", values_shape)):
        if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in shape):
            raise KVShapeError(f"{label} shape {shape} must hold integer dimensions")
    keys_shape = tuple(int(n) for n in keys_shape)
    values_shape = tuple(int(n) for n in values_shape)
    if len(keys_shape) != 4 or len(values_shape) != 4:
        raise KVShapeError(
            f"keys and values must be 4-D [B, H, S, D]; got keys {keys_shape}, values {values_shape}"
        )
    b, h, s, d = keys_shape
    vb, vh, vs, dv = values_shape
    if (b, h, s) != (vb, vh, vs):
        raise KVShapeError(f"keys {keys_shape} and values {values_shape} must agree on B, H and S")
    if min(b, h, s, d, dv) < 1:
        raise KVShapeError(f"every dimension must be >= 1; got keys {keys_shape}, values {values_shape}")
    if keys_dtype != values_dtype:
        raise KVDtypeError(f"keys dtype {keys_dtype} and values dtype {values_dtype} must match")
    if expected is not None and (b, h, d, dv) != tuple(expected):
        eb, eh, ed, edv = expected
        raise KVShapeError(
            f"B, H, D, Dv are fixed by the first update at ({eb}, {eh}, {ed}, {edv}); "
            f"got ({b}, {h}, {d}, {dv})"
        )
    return b, h, s, d, dv


def trim_count(n: Any, offset: int) -> int:
    """Validate ``trim(n)``'s argument and clamp it to ``offset``: how many tokens to drop.

    Raises ``KVTrimError`` unless ``n`` is an integer >= 0 (bools are refused), and
    ``KVConfigError`` when ``offset`` (the caller's own count) is not an integer >= 0.
    """
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or offset < 0:
        raise KVConfigError(f"trim_count(offset={offset!r}) needs the cache's token count, an int >= 0")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise KVTrimError(f"trim(n={n!r}) needs an int n >= 0 (a token count)")
    return min(int(n), int(offset))
