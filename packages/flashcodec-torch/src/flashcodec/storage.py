"""Measured storage of a codec cache, split the way the memory is actually used."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

from kvspec import KVConfigError

__all__ = ["CodecStorage"]


@dataclass(frozen=True)
class CodecStorage:
    """Bytes measured from the tensors a cache (or one stream) holds, by role.

    Attributes:
        used: archive bytes of the blocks actually archived (coefficients and their int8 scales,
            or anchors and deltas), i.e. ``.nbytes`` of the used slices of the archive buffers.
        tail: bytes of the tail tokens as stored (fewer than ``block_size + raw_window`` per
            stream; raw, or int8 codes with their scales and zero points).
        allocated: bytes reserved by the archive buffers at their full capacity plus the tail
            buffers (``block_size + raw_window`` slots less every whole ``TAIL_STEP`` = 16
            the tail leaves empty), used or not.
        view: bytes of the memoized reconstruction buffer (its full capacity; 0 once released).
            A decoded copy, not part of the compressed representation: reported separately.
        raw: bytes an uncompressed cache of the same dtype would hold for the same tokens.

    ``held = used + tail`` is what kvspec's ``nbytes`` reports and what ``state`` contains.
    Every field is a byte count: an integer >= 0 (``KVConfigError`` otherwise).
    """

    used: int = 0
    tail: int = 0
    allocated: int = 0
    view: int = 0
    raw: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise KVConfigError(
                    f"CodecStorage.{f.name} must be a byte count (an integer >= 0); got {value!r}"
                )

    @property
    def held(self) -> int:
        """``used + tail``: the compressed representation of the tokens (kvspec ``nbytes``)."""
        return self.used + self.tail

    @property
    def ratio(self) -> float:
        """``held / raw`` (below 1 means the cache saves memory)."""
        return self.held / self.raw if self.raw else float("nan")

    @property
    def resident(self) -> int:
        """Everything the cache keeps in memory: ``allocated + view``."""
        return self.allocated + self.view

    def __add__(self, other: CodecStorage) -> CodecStorage:
        if not isinstance(other, CodecStorage):
            return NotImplemented  # Python's TypeError naming both types
        return CodecStorage(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, float]:
        """Every field plus ``held``, ``resident`` and ``ratio``, for JSON results."""
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(held=self.held, resident=self.resident, ratio=self.ratio)
        return out
