"""An uncompressed numpy cache that meets the whole contract, and its conformance adapter.

It is the yardstick of the conformance suite: it proves every check can pass, and its
deliberately broken variants (``shared-tests/conformance/test_selftest.py``) prove every
check can fail. It is also the smallest complete example of a :class:`KVCacheLayer`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from .adapter import Adapter, CacheConfigCase, Capabilities
from .interface import KVConfigError, KVDtypeError, KVValueError, check_kv_pair, trim_count

__all__ = ["ReferenceConfig", "NumpyReferenceCache", "ReferenceAdapter"]

_ACCEPTED = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}
_BY_NAME = {name: dtype for dtype, name in _ACCEPTED.items()}


@dataclass(frozen=True)
class ReferenceConfig:
    """``step``: tokens added to the buffers' capacity each time they fill (like mlx-lm's 256).
    ``reject_nonfinite``: raise ``KVValueError`` on NaN / infinity input."""

    step: int = 64
    reject_nonfinite: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 1:
            raise KVConfigError(f"step must be an int >= 1; got {self.step!r}")


class NumpyReferenceCache:
    """Uncompressed K/V cache on numpy buffers that grow by ``config.step`` tokens.

    Accepts float32 and float16 ``[B, H, S, D]`` / ``[B, H, S, Dv]`` arrays (numpy has no
    bfloat16). B, H, D, Dv and the dtype are fixed by the first update. Output is a copy, so
    a caller never sees later writes through an earlier result.
    """

    def __init__(self, config: ReferenceConfig | None = None) -> None:
        self.config = config or ReferenceConfig()
        self._keys: np.ndarray | None = None  # [B, H, capacity, D]
        self._values: np.ndarray | None = None  # [B, H, capacity, Dv]
        self._offset = 0

    # ------------------------------------------------------------------ protocol
    @property
    def offset(self) -> int:
        return self._offset

    def empty(self) -> bool:
        return self._keys is None

    def _validate(self, keys: Any, values: Any) -> tuple[int, int, int, int, int]:
        for label, arr in (("keys", keys), ("values", values)):
            if not isinstance(arr, np.ndarray):
                raise KVDtypeError(f"{label} must be a numpy.ndarray; got {type(arr).__name__}")
        expected = None
        if self._keys is not None:
            expected = (self._keys.shape[0], self._keys.shape[1], self._keys.shape[3], self._values.shape[3])
        dims = check_kv_pair(keys.shape, values.shape, keys.dtype, values.dtype, expected)
        if keys.dtype not in _ACCEPTED:
            raise KVDtypeError(f"keys dtype must be one of {sorted(_ACCEPTED.values())}; got {keys.dtype}")
        if self._keys is not None and keys.dtype != self._keys.dtype:
            raise KVDtypeError(
                f"keys dtype is fixed by the first update at {self._keys.dtype}; got {keys.dtype}"
            )
        if self.config.reject_nonfinite:
            for label, arr in (("keys", keys), ("values", values)):
                if not np.all(np.isfinite(arr)):
                    bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
                    raise KVValueError(
                        f"{label} contain {bad} NaN or infinite values; only finite values are accepted"
                    )
        return dims

    def update_and_fetch(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append ``keys [B, H, S, D]`` and ``values [B, H, S, Dv]`` (float32 or float16).

        Returns copies of all keys ``[B, H, offset, D]`` and values ``[B, H, offset, Dv]``.
        Everything is validated before anything changes.
        """
        b, h, s, d, dv = self._validate(keys, values)
        needed = self._offset + s
        if self._keys is None or needed > self._keys.shape[2]:
            capacity = -(-needed // self.config.step) * self.config.step
            new_keys = np.zeros((b, h, capacity, d), dtype=keys.dtype)
            new_values = np.zeros((b, h, capacity, dv), dtype=values.dtype)
            if self._keys is not None:
                new_keys[:, :, : self._offset] = self._keys[:, :, : self._offset]
                new_values[:, :, : self._offset] = self._values[:, :, : self._offset]
            self._keys, self._values = new_keys, new_values
        self._keys[:, :, self._offset : needed] = keys
        self._values[:, :, self._offset : needed] = values
        self._offset = needed
        return self._keys[:, :, :needed].copy(), self._values[:, :, :needed].copy()

    @property
    def buffers(self) -> tuple[np.ndarray, ...]:
        """The arrays actually held, spare capacity included (empty tuple before the first update)."""
        return () if self._keys is None else (self._keys, self._values)

    @property
    def nbytes(self) -> int:
        return int(sum(buf.nbytes for buf in self.buffers))

    @property
    def raw_nbytes(self) -> int:
        if self._keys is None:
            return 0
        b, h, _, d = self._keys.shape
        return int(b * h * self._offset * (d + self._values.shape[3]) * self._keys.itemsize)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (clamped to ``offset``); return how many were dropped."""
        dropped = trim_count(n, self._offset)
        self._offset -= dropped
        return dropped

    @property
    def state(self) -> tuple[np.ndarray, ...]:
        """``(keys [B, H, offset, D], values [B, H, offset, Dv])`` views; ``()`` when empty."""
        if self._keys is None:
            return ()
        return self._keys[:, :, : self._offset], self._values[:, :, : self._offset]

    @property
    def meta_state(self) -> tuple[str, ...]:
        """``(offset, step, reject_nonfinite)`` as strings."""
        return (str(self._offset), str(self.config.step), str(int(self.config.reject_nonfinite)))

    @classmethod
    def from_state(cls, state: Any, meta_state: Any) -> NumpyReferenceCache:
        """Rebuild a cache from ``state`` and ``meta_state`` (copies the arrays).

        ``meta_state`` is what :attr:`meta_state` gives: three decimal strings (or integers)
        ``(offset, step, reject_nonfinite)``; anything else raises ``KVConfigError``.
        """
        if (
            isinstance(meta_state, (str, bytes))
            or not isinstance(meta_state, (tuple, list))
            or len(meta_state) != 3
        ):
            raise KVConfigError(
                f"meta_state={meta_state!r} must be a sequence of three values (offset, step, reject_nonfinite)"
            )
        try:
            offset, step, reject = (_meta_int(x) for x in meta_state)
        except (TypeError, ValueError):
            raise KVConfigError(f"meta_state={meta_state!r} must hold three non-negative integers") from None
        if reject not in (0, 1):
            raise KVConfigError(f"meta_state reject_nonfinite={reject} must be 0 or 1")
        cache = cls(ReferenceConfig(step=step, reject_nonfinite=bool(reject)))
        if state:
            keys, values = (np.asarray(a) for a in state)
            if keys.shape[2] != offset or values.shape[2] != offset:
                raise KVConfigError(
                    f"meta_state offset {offset} does not match state lengths {keys.shape[2]}, {values.shape[2]}"
                )
            cache.update_and_fetch(np.array(keys, copy=True), np.array(values, copy=True))
        return cache


def _meta_int(value: Any) -> int:
    """One ``meta_state`` entry as a non-negative integer (decimal strings and ints, no bools)."""
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral)):
        raise TypeError(value)
    number = int(value)
    if number < 0:
        raise ValueError(value)
    return number


class ReferenceAdapter(Adapter):
    """Conformance adapter for :class:`NumpyReferenceCache` (float32 and float16 only)."""

    name = "reference"
    dtypes = ("float32", "float16")
    long_seq = 256

    def configs(self) -> list[CacheConfigCase]:
        return [
            CacheConfigCase(
                name="raw",
                config=ReferenceConfig(step=64),
                capabilities=Capabilities(lossless=True, bitwise_lossless=True, compresses=False),
                default_tolerance=0.0,
            )
        ]

    def make(self, config: ReferenceConfig) -> NumpyReferenceCache:
        return NumpyReferenceCache(config)

    def to_native(self, array: np.ndarray, dtype: str) -> np.ndarray:
        if dtype not in _BY_NAME:
            raise KVDtypeError(f"the reference cache accepts dtypes {sorted(_BY_NAME)}; got {dtype!r}")
        return np.array(array, dtype=_BY_NAME[dtype], copy=True)

    def to_numpy(self, array: np.ndarray) -> np.ndarray:
        return np.asarray(array, dtype=np.float32)

    def dtype_name(self, array: np.ndarray) -> str:
        return _ACCEPTED.get(np.dtype(array.dtype), str(array.dtype))

    def restore(self, state: Any, meta_state: Any, config: ReferenceConfig) -> NumpyReferenceCache:
        return NumpyReferenceCache.from_state(state, meta_state)

    def held_arrays(self, cache: NumpyReferenceCache) -> list[np.ndarray]:
        # the buffers carry spare capacity that ``state`` (sliced to offset) does not show
        return list(cache.buffers)
