"""The first tokens of a sequence held exactly beside their codes (attention sinks).

Real pretrained models send a large share of every query's attention to the first token or
few (on SmolLM2-135M, 0.24-0.61 of the attention from layer 12 on goes to token 0), and those
tokens' keys and values are far from the typical token's. A coder tuned to the typical token
codes them badly, and because so much attention lands there, that one error moves every later
output. Keeping ``n`` such tokens exactly costs ``n`` rows of the input dtype per layer, head
and tensor, whatever the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from kvspec import KVDataError

from .int8_codes import int8_rows, int8_values

__all__ = ["ExactPrefix", "RecentWindow", "RECENT_BITS", "int8_rows", "int8_values"]

#: widths the recent window can hold its rows at: 16 (as given) or 8 (int8 per token and head)
RECENT_BITS: tuple[int, ...] = (16, 8)


@dataclass(frozen=True)
class ExactPrefix:
    """The first ``capacity`` tokens' keys and values as given (a cache's input dtype).

    Attributes:
        capacity: tokens kept (``palu_sink_tokens``).
        keys: ``[B, H, capacity, D]`` or None before the first write; keys as the cache received
            them (after RoPE on the pre-RoPE path: attention reads them as they are).
        values: ``[B, H, capacity, Dv]`` or None.

    Rows past a cache's ``offset`` (after a ``trim``) are stale and never read; the next append
    at those positions overwrites them.
    """

    capacity: int
    keys: mx.array | None = None
    values: mx.array | None = None

    def write(self, keys: mx.array, values: mx.array, prev: int) -> ExactPrefix:
        """The prefix after tokens ``[prev, prev + S)`` arrive (a new object; self is unchanged)."""
        stop = min(self.capacity, prev + keys.shape[2])
        if stop <= prev:
            return self
        held = []
        for buffer, new in ((self.keys, keys), (self.values, values)):
            if buffer is None:
                buffer = mx.zeros((*new.shape[:2], self.capacity, new.shape[3]), dtype=new.dtype)
            else:
                buffer = mx.array(buffer)  # a copy: the old object keeps its rows
            buffer[..., prev:stop, :] = new[..., : stop - prev, :]
            held.append(buffer)
        return ExactPrefix(self.capacity, *held)

    def count(self, offset: int) -> int:
        """Exact tokens readable at ``offset``: ``min(capacity, offset)`` once written, else 0."""
        return 0 if self.keys is None else min(self.capacity, offset)

    def arrays(self) -> list[mx.array]:
        """The arrays held (empty before the first write)."""
        return [] if self.keys is None else [self.keys, self.values]

    def tensor_arrays(self, which: str) -> list[mx.array]:
        """The arrays held for ``"key"`` or ``"value"`` (empty before the first write)."""
        if self.keys is None:
            return []
        return [self.keys if which == "key" else self.values]

    def overlay(self, rebuilt: mx.array, exact: mx.array | None, offset: int) -> mx.array:
        """``rebuilt [B, H, offset, ·]`` with its first :meth:`count` rows replaced by ``exact``'s."""
        m = self.count(offset)
        if not m or exact is None:
            return rebuilt
        return mx.concatenate([exact[..., :m, :].astype(rebuilt.dtype), rebuilt[..., m:, :]], axis=2)


@dataclass(frozen=True)
class RecentWindow:
    """The newest ``capacity`` tokens' keys and values as given, beside their codes.

    Every token is coded when it arrives; the window also keeps the newest ones exactly, and
    attention reads those rows instead of their codes, so the tokens a query attends to most
    (its own and its neighbours', for the many local heads of a real model) carry no coding
    error. The cost is ``capacity`` rows per layer, head and tensor, whatever the context.
    With ``bits=8`` (``palu_recent_bits``) the rows are held as int8 with one scale per token
    and head (:func:`int8_rows`, as flashcodec's int8 window holds them): about half the bytes,
    for an error near 2^-9 of each row's largest entry.

    Attributes:
        capacity: tokens kept (``palu_recent_tokens``).
        start: position of the first row held.
        keys: ``[B, H, n, D]`` rows for positions ``start .. start + n - 1`` (``n <= capacity``),
            or None before the first write; the caches :meth:`cut` it at a ``trim``, so its rows
            end at their ``offset``. int8 codes with ``bits=8``.
        values: ``[B, H, n, Dv]`` or None.
        bits: 16, rows as given; 8, int8 codes and the scales below.
        key_scales, value_scales: ``[B, H, n, 1]`` in the input dtype with ``bits=8``, else None.
    """

    capacity: int
    start: int = 0
    keys: mx.array | None = None
    values: mx.array | None = None
    bits: int = 16
    key_scales: mx.array | None = None
    value_scales: mx.array | None = None

    def _stored(self) -> list[mx.array | None]:
        """keys, values and (with ``bits=8``) their scales: the arrays a write concatenates."""
        return [self.keys, self.values, self.key_scales, self.value_scales][: 2 if self.bits == 16 else 4]

    def _new(self, start: int, arrays: list[mx.array]) -> RecentWindow:
        return RecentWindow(self.capacity, start, *arrays[:2], self.bits, *arrays[2:])

    def write(self, keys: mx.array, values: mx.array, prev: int) -> RecentWindow:
        """The window after tokens ``[prev, prev + S)`` arrive (a new object; self is unchanged)."""
        if self.capacity == 0:
            return self
        # the rows before ``prev`` still held; none unless they run up to ``prev`` without a gap
        held_to = self.start if self.keys is None else self.start + self.keys.shape[2]
        kept = prev - self.start if self.keys is not None and self.start <= prev <= held_to else 0
        start = self.start if kept else prev
        # only the rows that stay are coded (a long prefill keeps its last ``capacity``)
        skip = max(0, keys.shape[2] - self.capacity)
        if skip:  # copies: the window must not keep a long prefill's arrays alive
            keys, values = mx.contiguous(keys[..., skip:, :]), mx.contiguous(values[..., skip:, :])
        if self.bits == 8:
            (kc, ks), (vc, vs) = int8_rows(keys), int8_rows(values)
            fresh = [kc, vc, ks, vs]
        else:
            fresh = [keys, values]
        if skip:  # every row kept before is pushed out too
            return self._new(prev + skip, fresh)
        held = []
        for buffer, new in zip(self._stored(), fresh, strict=True):
            rows = mx.concatenate([buffer[..., :kept, :], new], axis=2) if kept else new
            held.append(rows)
        cut = max(0, held[0].shape[2] - self.capacity)
        if cut:
            held = [mx.contiguous(rows[..., cut:, :]) for rows in held]
        return self._new(start + cut, held)

    def cut(self, offset: int) -> RecentWindow:
        """The window after a ``trim`` to ``offset``: rows at or past it are dropped."""
        if self.keys is None or self.start + self.keys.shape[2] <= offset:
            return self
        keep = max(0, offset - self.start)
        if not keep:
            return RecentWindow(self.capacity, bits=self.bits)
        return self._new(self.start, [a[..., :keep, :] for a in self._stored()])

    def span(self, offset: int, floor: int = 0) -> tuple[int, int]:
        """Positions ``[lo, hi)`` read from the window at ``offset`` (none below ``floor``)."""
        if self.keys is None:
            return offset, offset
        hi = min(offset, self.start + self.keys.shape[2])
        lo = min(max(self.start, floor), hi)
        return lo, hi

    def rows(self, lo: int, hi: int) -> tuple[mx.array, mx.array]:
        """Keys and values of positions ``[lo, hi)`` (inside :meth:`span`), in the input dtype."""
        part = [a[..., lo - self.start : hi - self.start, :] for a in self._stored()]
        if self.bits == 8:
            return int8_values(part[0], part[2]), int8_values(part[1], part[3])
        return part[0], part[1]

    def arrays(self) -> list[mx.array]:
        """The arrays held (empty before the first write)."""
        return [] if self.keys is None else list(self._stored())

    def tensor_arrays(self, which: str) -> list[mx.array]:
        """The arrays held for ``"key"`` or ``"value"`` (empty before the first write)."""
        if self.keys is None:
            return []
        stored = self._stored()
        return stored[0::2] if which == "key" else stored[1::2]

    def state(self, offset: int) -> tuple[dict[str, mx.array], int | None]:
        """``({"recent.keys", "recent.values"}, start)`` (with ``bits=8`` the int8 codes, and
        ``recent.key_scales`` / ``recent.value_scales``): every row held up to ``offset``, or
        ``({}, None)``."""
        lo, hi = self.span(offset)
        if lo >= hi:
            return {}, None
        names = ("recent.keys", "recent.values", "recent.key_scales", "recent.value_scales")
        stored = self._stored()
        return {
            n: a[..., lo - self.start : hi - self.start, :]
            for n, a in zip(names[: len(stored)], stored, strict=True)
        }, lo

    def overlay(self, rebuilt: mx.array, which: int, offset: int, floor: int) -> mx.array:
        """``rebuilt [B, H, offset, ·]`` with its window rows (``which``: 0 keys, 1 values) put back."""
        lo, hi = self.span(offset, floor)
        if lo >= hi:
            return rebuilt
        exact = self.rows(lo, hi)[which].astype(rebuilt.dtype)
        return mx.concatenate([rebuilt[..., :lo, :], exact, rebuilt[..., hi:, :]], axis=2)


def read_recent(
    arrays,
    runtime: dict,
    capacity: int,
    shape: tuple[int, int, int, int],
    offset: int,
    dtype,
    owner: str,
    bits: int = 16,
) -> RecentWindow:
    """The :class:`RecentWindow` a state holds (``recent.keys`` / ``recent.values``, with ``bits=8``
    int8 and their ``recent.key_scales`` / ``recent.value_scales``, and the runtime's
    ``recent_start``), checked: a start outside ``[0, offset)``, more rows than ``capacity``
    or arrays of the wrong shape or dtype raise ``KVDataError`` naming them. ``arrays`` is a
    :class:`~palu_mlx.state_checks.StateArrays`."""
    start = runtime.get("recent_start")
    if start is None:  # no window, or trimmed back below it: the next tokens start a new one
        return RecentWindow(capacity, bits=bits)
    b, h, d, dv = shape
    if (
        isinstance(start, bool)
        or not isinstance(start, int)
        or not 0 <= start < offset
        or offset - start > capacity
    ):
        raise KVDataError(
            f"{owner}: meta_state recent_start={start!r} must be an int in [0, {offset}) "
            f"with at most palu_recent_tokens={capacity} tokens after it"
        )
    n = offset - start
    if bits == 8:
        keys = arrays.take("recent.keys", (b, h, n, d), mx.int8)
        values = arrays.take("recent.values", (b, h, n, dv), mx.int8)
        scales = [arrays.take(f"recent.{p}_scales", (b, h, n, 1), dtype) for p in ("key", "value")]
        return RecentWindow(capacity, start, mx.array(keys), mx.array(values), 8, *map(mx.array, scales))
    keys = arrays.take("recent.keys", (b, h, n, d), dtype)
    values = arrays.take("recent.values", (b, h, n, dv), dtype)
    return RecentWindow(capacity, start, mx.array(keys), mx.array(values))
