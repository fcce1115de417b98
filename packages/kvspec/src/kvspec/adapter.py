"""What a package provides so the conformance checks can drive its cache.

The checks in :mod:`kvspec.conformance` only see numpy arrays; an adapter turns
them into the package's arrays and back, builds caches from named
configurations, and declares what each configuration promises (capability
flags and a reconstruction tolerance per vector family).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .interface import KVCacheLayer

__all__ = ["Capabilities", "CacheConfigCase", "Adapter", "flatten_arrays"]


def flatten_arrays(tree: Any) -> list[Any]:
    """The array leaves of a ``state``-like tree (tuple / list / dict / None), in order.

    A leaf is anything with ``.nbytes`` and ``.shape`` (numpy, mlx, torch arrays); other
    leaves (ints, strings, None) hold no array bytes and are left out.
    """
    if tree is None:
        return []
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in flatten_arrays(value)]
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in flatten_arrays(item)]
    if hasattr(tree, "nbytes") and hasattr(tree, "shape"):
        return [tree]
    return []


@dataclass(frozen=True)
class Capabilities:
    """What a cache configuration promises; a check about a capability the case lacks is not run.

    lossless: output equals input within float rounding of the input dtype.
    bitwise_lossless: output equals input bit for bit.
    causal_stable: positions already returned never change (bitwise) after later appends.
    trimmable: ``trim`` is supported.
    serializable: ``state`` / ``meta_state`` round-trip through ``Adapter.restore``.
    rejects_nonfinite: NaN / inf input raises ``KVValueError``.
    compresses: ``nbytes < raw_nbytes`` once the sequence is long (see ``Adapter.long_seq``).
    deterministic: two caches fed the same input give bitwise equal output.
    """

    lossless: bool = False
    bitwise_lossless: bool = False
    causal_stable: bool = True
    trimmable: bool = True
    serializable: bool = True
    rejects_nonfinite: bool = True
    compresses: bool = False
    deterministic: bool = True


@dataclass(frozen=True)
class CacheConfigCase:
    """One named configuration of a package's cache, as the conformance suite sees it.

    ``config`` is passed back to ``Adapter.make`` untouched. ``tolerance`` maps a
    vector family (``"planted_lowrank"``, ``"random_walk"``, ``"gaussian"``,
    ``"outlier_keys"``, ``"edge"``, ``"real"``) to the largest relative Frobenius
    error ``||x_hat - x|| / ||x||`` allowed for keys and values. Families absent
    from the map use ``default_tolerance``.
    """

    name: str
    config: Any
    capabilities: Capabilities
    default_tolerance: float
    tolerance: dict[str, float] = field(default_factory=dict)

    def tolerance_for(self, family: str) -> float:
        return self.tolerance.get(family, self.default_tolerance)


class Adapter(ABC):
    """Bridge between numpy test vectors and one package's cache."""

    #: short package name used in test ids, e.g. ``"flashcodec"``
    name: str = "adapter"
    #: dtypes (``"float32"``, ``"float16"``, ``"bfloat16"``) this backend accepts
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    #: a sequence length at which compressing configurations must beat raw bytes
    long_seq: int = 256

    @abstractmethod
    def configs(self) -> list[CacheConfigCase]:
        """The configurations to check, easiest first."""

    @abstractmethod
    def make(self, config: Any) -> KVCacheLayer:
        """A new, empty cache for ``config``."""

    @abstractmethod
    def to_native(self, array: np.ndarray, dtype: str) -> Any:
        """numpy (float32 holding values representable in ``dtype``) -> backend array of ``dtype``."""

    @abstractmethod
    def to_numpy(self, array: Any) -> np.ndarray:
        """Backend array -> numpy float32 (exact for fp16 / bf16 / fp32)."""

    def dtype_name(self, array: Any) -> str:
        """The spec name (``"float32"``, ``"float16"``, ``"bfloat16"``) of a backend array's dtype."""
        return str(array.dtype).split(".")[-1]

    def restore(self, state: Any, meta_state: Any, config: Any) -> KVCacheLayer:
        """Rebuild a cache from ``state`` and ``meta_state`` (for serializable configs)."""
        raise NotImplementedError(f"{self.name} adapter does not implement restore")

    def sync(self, array: Any) -> Any:
        """Force evaluation of lazy arrays (mlx); identity elsewhere."""
        return array

    def held_arrays(self, cache: KVCacheLayer) -> list[Any]:
        """Every array ``cache`` holds; ``cache.nbytes`` must equal the sum of their ``.nbytes``.

        Default: the array leaves of ``cache.state``. Override when the cache holds more than
        its state shows (spare capacity in a growing buffer, a memoized view).
        """
        return flatten_arrays(cache.state)

    def snapshot_array(self, array: Any) -> np.ndarray:
        """A numpy copy of any held array with its exact bits (float or integer codes).

        Used to prove a rejected call changed nothing. Default: ``np.asarray(array).copy()`` when numpy
        can take it (numpy, CPU torch, mlx non-bfloat16 arrays), else ``to_numpy`` (exact for
        bfloat16 and for 8/16-bit integer codes). Override for packed 32-bit codes on a device.
        """
        array = self.sync(array)
        if self.dtype_name(array) != "bfloat16":
            try:
                # asarray then copy: np.array(copy=True) warns on torch's __array__ under numpy 2
                return np.asarray(array).copy()
            except (TypeError, ValueError, RuntimeError):
                pass
        return np.array(self.to_numpy(array), copy=True)
