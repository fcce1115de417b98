"""What one side of a chat turn measured, and how the two sides' replies agree.

Every field is read from the run (wall clock around the runner's calls, the cache's arrays, the
memory counters of the framework); nothing here is derived from a formula of sizes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SideStats", "TokenMatch", "token_match", "median_ms"]


@dataclass(frozen=True)
class SideStats:
    """One side (native or compressed) of one chat turn.

    Attributes:
        name: the cache (``native`` or a tier / peer name).
        context_tokens: tokens prefilled this turn (the whole conversation of this side).
        new_tokens: tokens generated this turn.
        kv_held: bytes the cache held after the turn (its compressed representation).
        kv_resident: bytes of everything the cache kept (held + spare capacity, views), when the
            cache can tell them apart; None otherwise.
        peak_bytes: memory high-water mark during the turn above the level before the cache
            existed (the runner's meter: MLX allocator, CUDA allocator or Linux VmHWM); None when
            the machine cannot measure it.
        steady_bytes: memory in use after the turn, the cache still alive, above the same level.
        prefill_s: seconds of the prefill call.
        step_s: seconds of each one-token call, in order.
        details: what the cache reports about its run (e.g. decode steps served on the codes).
    """

    name: str
    context_tokens: int
    new_tokens: int
    kv_held: int
    kv_resident: int | None
    peak_bytes: int | None
    steady_bytes: int | None
    prefill_s: float
    step_s: tuple[float, ...]
    details: dict | None = None

    @property
    def ms_per_token(self) -> float | None:
        """Median milliseconds of a one-token call (None when the turn made a single token)."""
        return median_ms(self.step_s)


@dataclass(frozen=True)
class TokenMatch:
    """Positions where the compressed reply's token equals the native one's."""

    same: int
    total: int
    first_divergence: int | None  # index of the first differing position; None when none differs

    @property
    def share(self) -> float | None:
        return self.same / self.total if self.total else None


def token_match(native: Sequence[int], compressed: Sequence[int]) -> TokenMatch:
    """Compare two replies position by position; a position only one reply reached (one stopped
    early at an end-of-text token) counts as a mismatch."""
    total = max(len(native), len(compressed))
    shorter = min(len(native), len(compressed))
    same = sum(native[i] == compressed[i] for i in range(shorter))
    diverged = [i for i in range(shorter) if native[i] != compressed[i]]
    first = diverged[0] if diverged else (shorter if shorter < total else None)
    return TokenMatch(same=same, total=total, first_divergence=first)


def median_ms(seconds: Sequence[float]) -> float | None:
    """Median of ``seconds`` in milliseconds (the median: one slow call from a busy machine does
    not move it); None for no calls."""
    return 1000.0 * statistics.median(seconds) if seconds else None
