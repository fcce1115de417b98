"""kvbench's one error: :class:`CompareError`, a mistake the user can fix, reported in one line.

Its own module, below every other, because every module (starting with the results files'
readers and the checks of their contents) reports mistakes with it.
"""

from __future__ import annotations

from kvspec import KVSpecError

__all__ = ["CompareError"]


class CompareError(KVSpecError, ValueError):
    """A mistake in a compare command (bad path, unknown tier, unusable model): one clear line."""
