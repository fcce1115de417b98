"""The batch form of palu's caches: what mlx-lm's continuous batching (``BatchGenerator``) needs.

mlx-lm batches requests only when every layer cache of the model has a ``merge`` (its server
checks ``hasattr(cache, "merge")`` once, when the model loads). ``merge`` turns one cache per
sequence into one batch cache per layer, which the model then calls with ``[B, H, S, D]`` keys
and values, a per-row ``offset`` (an ``mx.array``) and a left-padded causal mask.

A palu cache fits its projections to its own sequence, so sequences of a batch cannot share one
stacked code buffer. :class:`BatchedLayerCache` keeps one palu cache per row instead, each
holding only that row's real tokens in compressed form, and lays their reconstructed keys and
values out the way mlx-lm's ``BatchKVCache`` does (left padding, then the row's tokens; during a
right-padded prefill, pad columns after them until ``finalize``). Padding never reaches a row's
cache, so its positions (and its pre-RoPE keys) are the row's own token indices, exactly as on
the one-request path. ``extract(i)`` hands back row ``i``'s palu cache, which the server keeps
compressed in its prompt cache.

What this costs: the model attends over the rebuilt 16-bit history of every row (the latent
attention of :mod:`palu_mlx.attention` needs one projection per call, so batched calls take the
plain SDPA path); the history is rebuilt per step and not kept.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from kvspec import KVConfigError, KVShapeError
from mlx_lm.models.base import create_causal_mask

__all__ = ["BatchedLayerCache"]


def _held_tokens(cache: Any) -> tuple[mx.array, mx.array] | None:
    """The keys and values ``[1, H, offset, ·]`` a row's cache holds, without adding any (None if empty)."""
    if cache.offset == 0 or cache.empty():
        return None
    fetch = getattr(cache, "_fetch", None)
    if fetch is not None:
        return fetch()
    # NaiveQuantKVCache keeps quantized tuples and dequantizes on the way out
    return cache._dequantize(cache._keys), cache._dequantize(cache._values)


class BatchedLayerCache:
    """One layer's caches of a batch of sequences, in mlx-lm's batch-cache interface.

    Args:
        caches: one palu-mlx cache per sequence (each with ``batch size 1`` history, or empty).
            They are used as given: :meth:`merge` passes copies.
        left_padding: pad columns before each row's tokens (``max length - length`` at a merge).

    Attributes follow mlx-lm's ``BatchKVCache``: ``offset`` is the per-row position of the next
    token (``mx.array`` of ``B`` ints), ``left_padding`` the per-row pad columns, ``size()`` the
    columns of the padded layout. No ``bits`` attribute (mlx-lm would route to quantized SDPA).
    """

    def __init__(self, caches: Sequence[Any], left_padding: Sequence[int]):
        if len(caches) != len(left_padding):
            raise KVConfigError(
                f"left_padding has {len(left_padding)} entries for {len(caches)} caches; one per cache"
            )
        if any(int(p) < 0 for p in left_padding):
            raise KVConfigError(f"left_padding={list(left_padding)} must be non-negative")
        self.caches = list(caches)
        self._left = [int(p) for p in left_padding]
        self._idx = max((p + c.offset for p, c in zip(self._left, self.caches, strict=True)), default=0)
        # a right-padded prefill (prepare(right_padding=...) until finalize()): real tokens still
        # to come per row, and pad columns written after each row's tokens
        self._pending: list[int] | None = None
        self._trail = [0] * len(self.caches)
        # pad tokens at the start of the next input (prepare(left_padding=...) on an empty batch)
        self._lead = [0] * len(self.caches)

    # ------------------------------------------------------------------ mlx-lm's batch interface
    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchedLayerCache:
        """One batch cache from one cache per sequence (copies: the given caches are not changed)."""
        caches = list(caches)
        if not caches:
            raise KVConfigError("merge needs at least one cache")
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        return cls([copy.deepcopy(c) for c in caches], [longest - n for n in lengths])

    @property
    def offset(self) -> mx.array:
        """Per-row position of the next token: the columns after the row's left padding."""
        return mx.array([self._idx - p for p in self._left])

    @property
    def left_padding(self) -> mx.array:
        return mx.array(self._left)

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self._idx == 0 and all(c.empty() for c in self.caches)

    @property
    def nbytes(self) -> int:
        """Bytes the rows' caches hold (compressed); the rebuilt history handed to attention is not kept."""
        return sum(c.nbytes for c in self.caches)

    @property
    def state(self) -> list[mx.array]:
        """The arrays the rows' caches hold, for ``mx.eval`` (mlx-lm evaluates ``state`` after each prefill step)."""
        out: list[mx.array] = []
        for c in self.caches:
            held = getattr(c, "held_arrays", None)
            out += held() if held is not None else [a for a in c.state.values() if isinstance(a, mx.array)]
        return out

    @classmethod
    def from_state(cls, state: object, meta_state: object = None) -> BatchedLayerCache:
        """Refused: a batch cache's ``state`` holds the rows' arrays for ``mx.eval``, not what rebuilds
        them. Save each row's cache instead (``extract(i)``; mlx-lm's server keeps those)."""
        raise KVConfigError(
            "BatchedLayerCache cannot be rebuilt from a saved state: save the per-sequence caches "
            "(extract(i) for each row) with save_prompt_cache, and merge them again after loading"
        )

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Before a prompt chunk: ``right_padding`` pad tokens follow each row's ``lengths`` real ones
        (mlx-lm right-pads prompts of a batch); ``left_padding`` (only on an empty batch) precede them."""
        if left_padding is not None:
            if self._idx:
                raise KVConfigError("left padding can only be added to an empty batch cache")
            pads = [int(p) for p in left_padding]
            self._left = [a + p for a, p in zip(self._left, pads, strict=True)]
            self._lead = [a + p for a, p in zip(self._lead, pads, strict=True)]
        if right_padding is not None and max(int(p) for p in right_padding) > 0:
            if lengths is None:
                raise KVConfigError("prepare(right_padding=...) needs the rows' lengths")
            self._pending = [int(n) for n in lengths]

    def finalize(self) -> None:
        """After a right-padded prefill: the pad columns move before the row's tokens."""
        if self._pending is not None:
            self._left = [a + t for a, t in zip(self._left, self._trail, strict=True)]
            self._trail = [0] * len(self.caches)
            self._pending = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys [B, H, S, D]`` / ``values [B, H, S, Dv]`` (pad tokens are dropped per row);
        returns every row's history laid out in ``[B, H, size(), ·]`` with zeros in pad columns."""
        b, s = keys.shape[0], keys.shape[2]
        if b != len(self.caches):
            raise KVShapeError(f"keys have batch size {b}; this batch cache holds {len(self.caches)} rows")
        rows_k, rows_v = [], []
        for i, cache in enumerate(self.caches):
            skip = min(s, self._lead[i])
            self._lead[i] -= skip
            real = s - skip
            if self._pending is not None:
                real = min(real, self._pending[i])
                self._pending[i] -= real
            if real:
                k, v = cache.update_and_fetch(
                    keys[i : i + 1, :, skip : skip + real], values[i : i + 1, :, skip : skip + real]
                )
            else:
                k_v = _held_tokens(cache)
                k, v = k_v if k_v is not None else (None, None)
            self._trail[i] += s - skip - real
            rows_k.append(k)
            rows_v.append(v)
        self._idx += s
        return self._layout(rows_k, keys), self._layout(rows_v, values)

    def _layout(self, rows: list[mx.array | None], like: mx.array) -> mx.array:
        h = like.shape[1]
        width = next((r.shape[-1] for r in rows if r is not None), like.shape[-1])
        dtype = next((r.dtype for r in rows if r is not None), like.dtype)
        out = []
        for i, r in enumerate(rows):
            n = 0 if r is None else r.shape[2]
            before = self._idx - n - self._trail[i]
            parts = [mx.zeros((1, h, before, width), dtype)] if before else []
            if r is not None:
                parts.append(r.astype(dtype))
            if self._trail[i]:
                parts.append(mx.zeros((1, h, self._trail[i], width), dtype))
            out.append(mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0])
        return mx.concatenate(out, axis=0)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        """The causal mask of ``N`` new queries over the padded layout (mlx-lm's ``BatchKVCache`` rule)."""
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only the rows ``batch_indices`` (in that order), then drop pad columns no row needs."""
        keep = [int(i) for i in batch_indices]
        self.caches = [self.caches[i] for i in keep]
        self._left = [self._left[i] for i in keep]
        self._trail = [self._trail[i] for i in keep]
        self._lead = [self._lead[i] for i in keep]
        if self._pending is not None:
            self._pending = [self._pending[i] for i in keep]
        shift = min(self._left, default=0)
        if shift > 0:
            self._idx -= shift
            self._left = [p - shift for p in self._left]

    def extend(self, other: BatchedLayerCache) -> None:
        """Append ``other``'s rows (both right-aligned to the longer layout)."""
        if not isinstance(other, BatchedLayerCache):
            raise KVConfigError(f"cannot extend a palu batch cache with a {type(other).__name__}")
        idx = max(self._idx, other._idx)
        self._left = [p + idx - self._idx for p in self._left] + [p + idx - other._idx for p in other._left]
        self.caches += other.caches
        self._trail += other._trail
        self._lead += other._lead
        if self._pending is not None or other._pending is not None:
            mine = self._pending or [0] * (len(self.caches) - len(other.caches))
            self._pending = mine + (other._pending or [0] * len(other.caches))
        self._idx = idx

    def extract(self, idx: int) -> Any:
        """Row ``idx``'s palu cache (a copy; the batch keeps its own), holding only the row's tokens."""
        return copy.deepcopy(self.caches[idx])

    def is_trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.caches)

    def trim(self, n: int) -> int:
        """Drop the last ``n`` columns of every row (each row loses at most the tokens it holds)."""
        n = min(self._idx, int(n))
        for i, cache in enumerate(self.caches):
            from_trail = min(n, self._trail[i])
            self._trail[i] -= from_trail
            cache.trim(n - from_trail)
        self._idx -= n
        # a row shorter than the cut loses its left padding too
        self._left = [
            min(p, self._idx - c.offset - t)
            for p, c, t in zip(self._left, self.caches, self._trail, strict=True)
        ]
        return n

    def __repr__(self) -> str:
        return f"BatchedLayerCache(rows={len(self.caches)}, columns={self._idx})"
