"""What palu-mlx's cache layers share: input checks, growing buffers and the mlx-lm interface.

:class:`CacheLayer` holds the token count, the ``(B, H, D, Dv)`` shape and the dtype fixed by
the first ``update_and_fetch``, and implements everything that depends only on them: the
mlx-lm methods (``size``, ``empty``, ``is_trimmable``, ``trim``, ``make_mask``), the raw byte
count and :meth:`~CacheLayer.storage_stats`. Subclasses own their buffers and report
``nbytes`` from them.
"""

from __future__ import annotations

import numbers
from typing import Any

import mlx.core as mx
from kvspec import (
    KVConfigError,
    KVDtypeError,
    KVShapeError,
    KVValueError,
    StorageStats,
    check_kv_pair,
    trim_count,
)
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import create_attention_mask

from .batch import BatchedLayerCache

__all__ = [
    "CacheLayer",
    "SUPPORTED_DTYPES",
    "dtype_name",
    "dtype_from_name",
    "write_rows",
    "detached",
    "mlx_lm_loadable",
    "register_cache_classes",
]

SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def dtype_name(dtype: mx.Dtype) -> str:
    """``mx.float16`` -> ``"float16"`` (the name stored in ``meta_state``)."""
    return str(dtype).split(".")[-1]


def dtype_from_name(name: str) -> mx.Dtype:
    """Inverse of :func:`dtype_name` for the supported dtypes; raises ``KVDtypeError`` otherwise."""
    # looked up by name: comparing whatever ``getattr(mx, name)`` returns with an mx.Dtype raises
    # a TypeError from mlx for most objects, which would escape as a non-kvspec error
    dtype = {dtype_name(d): d for d in SUPPORTED_DTYPES}.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise KVDtypeError(f"dtype {name!r} is not one of float16, bfloat16, float32")
    return dtype


# --------------------------------------------------------------------------- mlx-lm's class lookup
#: the cache classes mlx-lm's ``load_prompt_cache`` must find by name (filled by :func:`mlx_lm_loadable`)
_LOADABLE: dict[str, type] = {"BatchedLayerCache": BatchedLayerCache}


def mlx_lm_loadable(cls: type) -> type:
    """Class decorator: ``cls`` is a cache class mlx-lm's ``load_prompt_cache`` may have to rebuild
    (every subclass of :class:`CacheLayer` in palu_mlx is one without it)."""
    _LOADABLE[cls.__name__] = cls
    return cls


def register_cache_classes(strict: bool = True, extra: tuple[type, ...] = ()) -> None:
    """Add every :func:`mlx_lm_loadable` class (and ``BatchedLayerCache``) to ``mlx_lm.models.cache``.

    mlx-lm rebuilds a saved layer with ``globals()[class_name].from_state(state)`` inside that
    module, so a palu cache saved with mlx-lm's ``save_prompt_cache`` loads only once its class is
    a name there. Every palu cache's constructor calls this (``strict=False``), so a process that
    made a cache can load what it saved. Idempotent; a name mlx-lm already uses for something else
    is never overwritten: ``KVConfigError`` when ``strict``, else that class is left out. ``extra``:
    further classes to add the same way.
    """
    for cls in (*_LOADABLE.values(), *extra):
        name = cls.__name__
        present = getattr(mlx_cache, name, None)
        if present is None:
            setattr(mlx_cache, name, cls)
        elif present is not cls and strict:
            raise KVConfigError(
                f"mlx_lm.models.cache already defines {name!r} ({present!r}); palu-mlx cannot "
                "register its cache class of that name for mlx-lm's load_prompt_cache"
            )


def detached(arr: mx.array) -> mx.array:
    """A copy with its own memory, for ``state``: mx.array exposes its buffer to numpy
    (``np.asarray(a)`` is a writable view), so handing out a slice of a cache buffer would let
    a caller rewrite the cache. The copy costs one pass over the state's bytes."""
    return mx.array(arr)


def write_rows(buffer: mx.array | None, new: mx.array, prev: int, step: int) -> mx.array:
    """Write ``new [B, H, s, w]`` at token positions ``[prev, prev + s)`` of ``buffer``.

    Grows the buffer to the next multiple of ``step`` tokens when needed, keeping
    its first ``prev`` tokens. Returns the (possibly new) buffer.
    """
    end = prev + new.shape[2]
    if buffer is None or end > buffer.shape[2]:
        capacity = -(-end // step) * step
        grown = mx.zeros((*new.shape[:2], capacity, new.shape[3]), dtype=new.dtype)
        if buffer is not None and prev > 0:
            grown[..., :prev, :] = buffer[..., :prev, :]
        buffer = grown
    buffer[..., prev:end, :] = new
    return buffer


class CacheLayer:
    """Base of :class:`~palu_mlx.cache.PaluKVCache` (and so of
    :class:`~palu_mlx.calibrated.CalibratedKVCache`, the same cache on a calibration's projections)
    and :class:`~palu_mlx.baseline.NaiveQuantKVCache`.

    Subclasses call :meth:`_validate` first in ``update_and_fetch``, store the new
    tokens, then set ``_shape``, ``_dtype`` and ``offset``; they define ``nbytes``.
    """

    #: buffers grow by this many tokens at a time (as mlx-lm's ``KVCache``)
    step = 256

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # every palu-mlx cache class is one mlx-lm may have to rebuild from a saved file; a user's
        # own subclass is not added to mlx-lm's names
        if cls.__module__.startswith("palu_mlx."):
            mlx_lm_loadable(cls)

    def __init__(self) -> None:
        register_cache_classes(strict=False)
        self.offset = 0
        self._shape: tuple[int, int, int, int] | None = None  # (B, H, D, Dv), fixed by the first call
        self._dtype: mx.Dtype | None = None

    # ------------------------------------------------------------------ validation
    def _check_dims(self, h: int, d: int, dv: int) -> None:
        """Subclass hook: reject head counts or head dims this cache cannot hold."""

    def _validate(self, keys: Any, values: Any, check_finite: bool) -> tuple[int, int, int, int, int]:
        """Check one ``update_and_fetch`` call; returns ``(B, H, S, D, Dv)``. Raises before any change."""
        if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
            raise KVDtypeError(
                f"keys and values must be mlx.core.array; got {type(keys).__name__}, {type(values).__name__}"
            )
        b, h, s, d, dv = check_kv_pair(keys.shape, values.shape, keys.dtype, values.dtype, self._shape)
        if keys.dtype not in SUPPORTED_DTYPES:
            raise KVDtypeError(
                f"keys dtype {keys.dtype} is not supported; allowed: float16, bfloat16, float32"
            )
        if self._dtype is not None and keys.dtype != self._dtype:
            raise KVDtypeError(f"keys dtype {keys.dtype} differs from the cache's dtype {self._dtype}")
        self._check_dims(h, d, dv)
        # last: the only check that syncs the device
        if check_finite and not (mx.all(mx.isfinite(keys)) & mx.all(mx.isfinite(values))).item():
            raise KVValueError("keys or values contain NaN or infinity; the cache only accepts finite values")
        return b, h, s, d, dv

    # ------------------------------------------------------------------ mlx-lm interface
    def size(self) -> int:
        """Tokens held (``offset``)."""
        return self.offset

    def empty(self) -> bool:
        """True when no token has been added yet."""
        return self._shape is None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (clamped to ``offset``); returns how many were dropped."""
        n = trim_count(n, self.offset)
        self.offset -= n
        return n

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        """mlx-lm's batch path: one :class:`~palu_mlx.batch.BatchedLayerCache` from one cache per
        sequence (copies). Its presence is what makes mlx-lm's server batch requests."""
        return BatchedLayerCache.merge(caches)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The attention mask for ``N`` new queries (same rules as mlx-lm's ``KVCache``)."""
        if isinstance(N, bool) or not isinstance(N, numbers.Integral) or N < 1:
            raise KVShapeError(f"make_mask(N={N!r}) needs the number of new queries, an int >= 1")
        if not isinstance(return_array, bool):
            raise KVConfigError(f"make_mask(return_array={return_array!r}) must be True or False")
        if window_size is not None and (
            isinstance(window_size, bool) or not isinstance(window_size, numbers.Integral) or window_size < 1
        ):
            raise KVConfigError(f"make_mask(window_size={window_size!r}) must be None or an int >= 1")
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    # ------------------------------------------------------------------ state
    def _runtime(self) -> dict[str, Any]:
        """The runtime half of ``meta_state``: class, offset, shape and dtype."""
        return {
            "class": type(self).__name__,
            "offset": self.offset,
            "shape": list(self._shape) if self._shape else None,
            "dtype": dtype_name(self._dtype) if self._dtype is not None else None,
        }

    # ------------------------------------------------------------------ copy and pickle
    # mlx-lm's server and BatchGenerator deep-copy prompt caches, and its distributed server
    # pickles them. mx.array does both, mx.Dtype neither: the dtype travels by name. Copies share
    # array memory with the original until either writes, and every write the cache makes is an
    # mx operation that gives the written array new memory, so the two never see each other's
    # updates (tests/test_copies.py checks this).
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if state.get("_dtype") is not None:
            state["_dtype"] = dtype_name(state["_dtype"])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if state.get("_dtype") is not None:
            state["_dtype"] = dtype_from_name(state["_dtype"])
        self.__dict__.update(state)

    # ------------------------------------------------------------------ measured storage
    @property
    def nbytes(self) -> int:
        """Bytes of every array held (buffers at their full grown capacity)."""
        raise NotImplementedError

    def _elements(self) -> tuple[int, int]:
        """``(B*H*offset*D, B*H*offset*Dv)``: the key and value elements the cache represents."""
        if self._shape is None:
            return 0, 0
        b, h, d, dv = self._shape
        return b * h * self.offset * d, b * h * self.offset * dv

    @property
    def raw_nbytes(self) -> int:
        """Bytes an uncompressed cache of the input dtype would hold for the same tokens."""
        if self._dtype is None:
            return 0
        return self._dtype.size * sum(self._elements())

    def storage_stats(self) -> StorageStats:
        """Measured storage (``nbytes``, ``raw_nbytes``, bits per element) as a :class:`kvspec.StorageStats`."""
        return StorageStats(
            tokens=self.offset,
            nbytes=self.nbytes,
            raw_nbytes=self.raw_nbytes,
            elements=sum(self._elements()),
        )
