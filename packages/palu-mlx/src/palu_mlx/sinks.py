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

__all__ = ["ExactPrefix"]


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

    def overlay(self, rebuilt: mx.array, exact: mx.array | None, offset: int) -> mx.array:
        """``rebuilt [B, H, offset, ·]`` with its first :meth:`count` rows replaced by ``exact``'s."""
        m = self.count(offset)
        if not m or exact is None:
            return rebuilt
        return mx.concatenate([exact[..., :m, :].astype(rebuilt.dtype), rebuilt[..., m:, :]], axis=2)
