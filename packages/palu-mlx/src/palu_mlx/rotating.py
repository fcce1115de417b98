"""A bounded palu cache for sliding-window layers, with mlx-lm's ``RotatingKVCache`` behaviour.

mlx-lm gives sliding-window layers (gemma3's local layers, every layer under
``make_prompt_cache(model, max_kv_size)``) a ``RotatingKVCache(max_size, keep)``: it keeps the
first ``keep`` tokens and the newest ones, so that every query sees at most ``max_size`` tokens
(a prefill chunk of ``S`` tokens sees the ``max_size - 1`` tokens before it and the chunk, with a
windowed causal mask). :class:`RotatingPaluKVCache` gives the model's attention the same tokens
in the same layout, coded by a :class:`~palu_mlx.cache.PaluKVCache` (or
:class:`~palu_mlx.calibrated.CalibratedKVCache`) that holds only those rows.

**How the rows are held.** The wrapped cache holds the rows in temporal order and knows nothing
of the window: its row ``i`` is token ``i`` for ``i < keep`` and token ``i + shift`` after that,
where ``shift`` counts the tokens dropped. Dropping rows is one copy of the held codes, so it is
done in chunks: once more than ``max_size - 1 + slack`` rows are held (``slack`` a quarter of the
window, at most 256 rows), the oldest rows after the first ``keep`` are cut back to
``max_size - 1``, the fewest the next call needs. Rows are first dropped after the projections
are fitted: a window shorter than the fit's token count is still coded (the fit then reads some
tokens that have left the window; the attention never does).

**Pre-RoPE keys.** Codes of keys before RoPE do not depend on the position, so dropping rows
leaves them valid; the wrapped cache's :class:`~palu_mlx.rope.Rotary` is replaced by a
:class:`HeldRotary` that rotates row ``i`` at its token's position (``i`` or ``i + shift``).
The exact rows it keeps (attention sinks, the recent window) are post-RoPE keys as the model
gave them and move with their rows. Sink rows beyond ``keep`` would name tokens that left the
window: when rows are dropped they are refilled with what the codes of their new tokens give,
so attention reads those tokens as it would without sinks.

**Attention.** The cache offers no latent store (the codes' row indices are not token positions
once rows are dropped), so the routed attention falls back to mlx-lm's on the rows
``update_and_fetch`` returns: at most ``max_size - 1 + S`` of them, however long the sequence.
It has no ``merge`` either: mlx-lm's server serves a model with these caches one request at a
time, as it can batch only caches that merge.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any

import mlx.core as mx
from kvspec import KVConfigError, KVDataError, KVShapeError, KVSpecError, StorageStats
from mlx_lm.models.base import create_causal_mask

from .cache import PaluKVCache
from .calibrated import CalibratedKVCache
from .layer import mlx_lm_loadable, register_cache_classes, write_rows
from .rope import Rotary
from .rotation_code import RotationKVCache
from .sinks import ExactPrefix, RecentWindow
from .state_checks import parse_meta_state, read_field, split_state, with_meta

__all__ = ["RotatingPaluKVCache", "HeldRotary"]

#: the caches a rotating cache can hold its rows in, by the class name its state records
_INNER: dict[str, type[PaluKVCache]] = {
    "PaluKVCache": PaluKVCache,
    "CalibratedKVCache": CalibratedKVCache,
    "RotationKVCache": RotationKVCache,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class HeldRotary(Rotary):
    """A :class:`Rotary` whose row ``i`` sits at position ``i`` below ``keep`` and ``i + shift`` from it.

    Attributes:
        keep: rows held at their own positions (the first ``keep`` tokens).
        shift: tokens dropped after them (rows from ``keep`` on sit this much further along).
    """

    keep: int = 0
    shift: int = 0

    @classmethod
    def of(cls, rotary: Rotary, keep: int, shift: int = 0) -> HeldRotary:
        return cls(rotary.inv_freq, rotary.dims, rotary.traditional, keep, shift)

    def _held(self, x: mx.array, offset: int, sign: float) -> mx.array:
        s = x.shape[2]
        split = min(max(self.keep - offset, 0), s)  # rows of x below ``keep``
        if self.shift == 0 or split == s:
            return self._rope(x, offset, sign)
        if split == 0:
            return self._rope(x, offset + self.shift, sign)
        return mx.concatenate(
            [
                self._rope(x[..., :split, :], offset, sign),
                self._rope(x[..., split:, :], self.keep + self.shift, sign),
            ],
            axis=2,
        )

    def rotate(self, x: mx.array, offset: int = 0) -> mx.array:
        """RoPE of rows ``offset .. offset+S-1`` at their tokens' positions; float32 out."""
        return self._held(x, offset, 1.0)

    def unrotate(self, x: mx.array, offset: int = 0) -> mx.array:
        """Inverse of :meth:`rotate`; float32 out."""
        return self._held(x, offset, -1.0)


def _check_window(max_size: Any, keep: Any, error: type[KVSpecError], where: str) -> None:
    if not _is_int(max_size) or max_size < 1:
        raise error(f"{where}max_size={max_size!r} must be an int >= 1 (the tokens a query may see)")
    if not _is_int(keep) or not 0 <= keep < max_size:
        raise error(f"{where}keep={keep!r} must be an int in [0, max_size={max_size}) (tokens always kept)")


@mlx_lm_loadable
class RotatingPaluKVCache:
    """A palu cache with the interface and attention semantics of mlx-lm's ``RotatingKVCache``.

    Args:
        cache: a fresh (empty) :class:`~palu_mlx.cache.PaluKVCache`,
            :class:`~palu_mlx.calibrated.CalibratedKVCache` or
            :class:`~palu_mlx.rotation_code.RotationKVCache` that codes the rows; this cache owns it
            from now on (its RoPE is replaced by a :class:`HeldRotary`).
        max_size: tokens a query sees at most (mlx-lm's ``max_size``: the sliding window).
        keep: the first tokens kept whatever the window (mlx-lm's ``keep``), ``< max_size``.

    ``offset`` counts every token added; ``size()`` is ``min(offset, max_size)``. Bad arguments
    raise ``KVConfigError``; a bad ``update_and_fetch`` raises as the wrapped cache does and
    leaves this cache unchanged.
    """

    def __init__(self, cache: PaluKVCache, max_size: int, keep: int = 0):
        if type(cache) not in _INNER.values():
            raise KVConfigError(f"cache must be one of {', '.join(_INNER)}; got {type(cache).__name__}")
        if not cache.empty():
            raise KVConfigError(f"cache must be empty (a fresh cache); it holds {cache.offset} tokens")
        _check_window(max_size, keep, KVConfigError, "")
        register_cache_classes(strict=False)  # as every palu cache: its saved file loads in mlx-lm
        self._setup(cache, max_size, keep, 0)

    def _setup(self, cache: PaluKVCache, max_size: int, keep: int, offset: int) -> None:
        self.max_size, self.keep, self.offset = max_size, keep, offset
        if cache.rotary is not None:
            cache.rotary = HeldRotary.of(cache.rotary, keep, offset - cache.offset)
        # rows beyond the held ones are reserved in steps of the slack, not of 256 tokens
        cache.step = self.slack
        self.cache = cache

    @property
    def slack(self) -> int:
        """Rows held beyond ``max_size - 1`` before the oldest are dropped (in one copy)."""
        return max(1, min(PaluKVCache.step, self.max_size // 4))

    @property
    def config(self):
        """The wrapped cache's :class:`~palu_mlx.config.KVCacheConfig`."""
        return self.cache.config

    @property
    def rotary(self) -> Rotary | None:
        """The RoPE keys are coded before (a :class:`HeldRotary`), or None."""
        return self.cache.rotary

    @property
    def fitted(self) -> bool:
        return self.cache.fitted

    # ------------------------------------------------------------------ update
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add ``keys [B, H, S, D]`` and ``values [B, H, S, Dv]``; returns what ``RotatingKVCache``
        would: every token while fewer than ``max_size`` came before, else the first ``keep``
        tokens, the newest ``max_size - 1 - keep`` before these and these, in temporal order."""
        prev, held = self.offset, self.cache.offset
        all_keys, all_values = self.cache.update_and_fetch(keys, values)  # raises before any change
        self.offset = prev + keys.shape[2]
        if prev < self.max_size:
            out_keys, out_values = all_keys, all_values  # nothing was dropped yet
        else:
            start = held - (self.max_size - 1 - self.keep)  # the first old row after the kept ones
            out_keys, out_values = (self._rows(a, start) for a in (all_keys, all_values))
        if self.cache.fitted and self.cache.offset > self.max_size - 1 + self.slack:
            self._drop(self.cache.offset - (self.max_size - 1), all_keys, all_values)
        return out_keys, out_values

    def _rows(self, rows: mx.array, start: int) -> mx.array:
        """Rows ``[0, keep)`` and ``[start, end)`` of ``rows``."""
        if start <= self.keep:
            return rows
        if not self.keep:
            return rows[..., start:, :]
        return mx.concatenate([rows[..., : self.keep, :], rows[..., start:, :]], axis=2)

    def _drop(self, k: int, all_keys: mx.array, all_values: mx.array) -> None:
        """Drop held rows ``[keep, keep + k)``. ``all_keys`` / ``all_values``: every held row as
        attention reads it (what the wrapped cache returned), for the sink rows past ``keep``."""
        inner, keep = self.cache, self.keep
        held = inner.offset
        cut = lambda buf: mx.concatenate([buf[..., :keep, :], buf[..., keep + k : held, :]], axis=2)  # noqa: E731
        key_codes = {n: write_rows(None, cut(b), 0, inner.step) for n, b in inner._key_codes.items()}
        value_codes = {n: write_rows(None, cut(b), 0, inner.step) for n, b in inner._value_codes.items()}
        sinks = inner._sinks
        stop = min(sinks.capacity, held - k)
        if sinks.keys is not None and stop > keep:
            # sink rows past ``keep`` now name other tokens: what attention read for those
            refilled = []
            for buffer, rows in ((sinks.keys, all_keys), (sinks.values, all_values)):
                buffer = mx.array(buffer)
                buffer[..., keep:stop, :] = rows[..., keep + k : stop + k, :].astype(buffer.dtype)
                refilled.append(buffer)
            sinks = ExactPrefix(sinks.capacity, *refilled)
        inner._key_codes, inner._value_codes = key_codes, value_codes
        inner._sinks, inner._recent = sinks, _cut_recent(inner._recent, keep, k)
        if inner.rotary is not None:
            inner.rotary = dataclasses.replace(inner.rotary, shift=inner.rotary.shift + k)
        inner.offset = held - k

    # ------------------------------------------------------------------ mlx-lm interface
    def size(self) -> int:
        """Tokens a query sees at most now: ``min(offset, max_size)`` (as ``RotatingKVCache``)."""
        return min(self.offset, self.max_size)

    def empty(self) -> bool:
        return self.cache.empty()

    def is_trimmable(self) -> bool:
        """True while ``offset < max_size`` (no token has left the window), as ``RotatingKVCache``."""
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (clamped to ``offset``); returns how many were dropped.

        Only while :meth:`is_trimmable`: once tokens have left the window the cache cannot go back
        to an earlier one (``KVConfigError``; ``trim(0)`` is always allowed)."""
        if _is_int(n) and n > 0 and not self.is_trimmable():
            raise KVConfigError(
                f"trim({n}): offset={self.offset} has reached max_size={self.max_size}, so tokens have "
                "left the window and cannot be restored; trim only while is_trimmable() is True"
            )
        n = self.cache.trim(n)  # checks n
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The mask for ``N`` new queries over the rows :meth:`update_and_fetch` will return
        (``RotatingKVCache.make_mask``'s rules; rows in temporal order)."""
        if not _is_int(N) or N < 1:
            raise KVShapeError(f"make_mask(N={N!r}) needs the number of new queries, an int >= 1")
        if not isinstance(return_array, bool):
            raise KVConfigError(f"make_mask(return_array={return_array!r}) must be True or False")
        if window_size is not None and (not _is_int(window_size) or window_size < 1):
            raise KVConfigError(f"make_mask(window_size={window_size!r}) must be None or an int >= 1")
        if N > 1:
            window_size = window_size or self.max_size
            before = min(self.max_size - 1, self.offset)  # old rows the chunk will see
            if before + N > window_size or return_array:
                return create_causal_mask(N, before, window_size=window_size)
            return "causal"
        if window_size is None or self.offset < window_size or self.max_size <= window_size:
            return None
        # a window narrower than the rows held: the newest window_size of them
        rows = min(self.offset + 1, self.max_size)
        return mx.arange(rows) >= rows - window_size

    # ------------------------------------------------------------------ storage
    @property
    def nbytes(self) -> int:
        """Bytes of every per-sequence array held (the wrapped cache's, buffers at full capacity)."""
        return self.cache.nbytes

    @property
    def constant_nbytes(self) -> int:
        return self.cache.constant_nbytes

    def held_arrays(self) -> list[mx.array]:
        return self.cache.held_arrays()

    @property
    def raw_nbytes(self) -> int:
        """Bytes mlx-lm's ``RotatingKVCache`` holds for the same tokens in the input dtype
        (``size()`` rows; a formula)."""
        inner = self.cache
        if inner._shape is None:
            return 0
        b, h, d, dv = inner._shape
        return inner._dtype.size * b * h * self.size() * (d + dv)

    def storage_stats(self) -> StorageStats:
        """Measured storage of the rows held, as a :class:`kvspec.StorageStats`."""
        inner = self.cache
        elements = 0
        if inner._shape is not None:
            b, h, d, dv = inner._shape
            elements = b * h * self.size() * (d + dv)
        return StorageStats(
            tokens=self.size(), nbytes=self.nbytes, raw_nbytes=self.raw_nbytes, elements=elements
        )

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> dict[str, mx.array]:
        """The wrapped cache's state arrays (its rows held) and ``meta_state`` (this cache's
        :attr:`meta_state` and a checksum), as :attr:`PaluKVCache.state` lays them out; copies."""
        return with_meta(type(self).__name__, self.cache._state_arrays(), self.meta_state)

    @property
    def meta_state(self) -> tuple[str, str]:
        """``(config JSON, runtime JSON)``: the runtime has ``offset``, ``max_size``, ``keep`` and
        the wrapped cache's class and runtime JSON (whose offset is the rows held)."""
        settings, inner_runtime = self.cache.meta_state
        runtime = {
            "class": type(self).__name__,
            "offset": self.offset,
            "max_size": self.max_size,
            "keep": self.keep,
            "inner": {"class": type(self.cache).__name__, "runtime": inner_runtime},
        }
        return settings, json.dumps(runtime, sort_keys=True)

    @classmethod
    def from_state(
        cls, state: dict[str, mx.array], meta_state: tuple[str, str] | list[str] | None = None
    ) -> RotatingPaluKVCache:
        """Rebuild a cache from :attr:`state` (and :attr:`meta_state`; None reads the one the
        state carries, as mlx-lm's ``load_prompt_cache`` needs). Every field is checked first:
        a mismatch raises ``KVDataError`` naming it."""
        owner = f"{cls.__name__}.from_state"
        arrays, meta_state = split_state(state, meta_state, cls.__name__, owner)
        _, runtime = parse_meta_state(meta_state, owner)
        saved_class = read_field(runtime, "class", owner)
        if saved_class != cls.__name__:
            raise KVDataError(
                f"{owner}: meta_state was written by class {saved_class!r}; expected {cls.__name__!r}"
            )
        offset, max_size, keep, inner = (
            read_field(runtime, f, owner) for f in ("offset", "max_size", "keep", "inner")
        )
        if not _is_int(offset) or offset < 0:
            raise KVDataError(f"{owner}: meta_state offset={offset!r} must be an int >= 0 (the token count)")
        _check_window(max_size, keep, KVDataError, f"{owner}: meta_state ")
        if (
            not isinstance(inner, dict)
            or inner.get("class") not in _INNER
            or not isinstance(inner.get("runtime"), str)
            or set(inner) != {"class", "runtime"}
        ):
            raise KVDataError(
                f"{owner}: meta_state inner={inner!r:.200} must be {{'class': one of {sorted(_INNER)}, "
                "'runtime': the wrapped cache's runtime JSON}"
            )
        try:
            cache = _INNER[inner["class"]].from_state(arrays, (meta_state[0], inner["runtime"]))
        except KVSpecError as exc:
            raise KVDataError(f"{owner}: the wrapped {inner['class']}: {exc}") from None
        held = cache.offset
        if held > offset or (held < offset and (not cache.fitted or held < max_size - 1 or held < keep)):
            raise KVDataError(
                f"{owner}: meta_state offset={offset} with {held} rows held: rows are dropped only after "
                f"the fit and never below max_size - 1 = {max_size - 1}; expected {offset} rows, or "
                f"between {max_size - 1} and {offset} of a fitted cache"
            )
        out = cls.__new__(cls)
        out._setup(cache, max_size, keep, offset)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(offset={self.offset}, max_size={self.max_size}, keep={self.keep}, {self.cache!r})"


def _cut_recent(recent: RecentWindow, keep: int, k: int) -> RecentWindow:
    """``recent`` after held rows ``[keep, keep + k)`` are dropped: its rows there go, those after
    move ``k`` rows down (positions are the held rows' indices)."""
    if recent.keys is None:
        return recent
    n = recent.keys.shape[2]
    lo, hi = min(max(keep - recent.start, 0), n), min(max(keep + k - recent.start, 0), n)
    start = recent.start if recent.start < keep else max(recent.start, keep + k) - k
    if lo == hi:
        return dataclasses.replace(recent, start=start)
    if lo == 0 and hi == n:
        return RecentWindow(recent.capacity, bits=recent.bits)
    stored = recent._stored()
    rows = [mx.concatenate([a[..., :lo, :], a[..., hi:, :]], axis=2) for a in stored]
    return recent._new(start, rows)
