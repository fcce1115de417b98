"""The rotation code as a coder choice: nothing fitted but each head's mean.

:class:`Rotation` is what a :class:`~palu_mlx.config.KVCacheConfig` holds for ``method="rotation"``;
the code itself (a fixed Hadamard rotation of each head's channels, ``bits`` per rotated channel
under a per-token scale) is :mod:`palu_mlx.rotation_code`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Rotation", "DEFAULT_ROTATION_BITS", "ROTATION_BITS_ALLOWED"]

#: bits per rotated channel of ``KVCacheConfig()``: the smallest tier needing no file whose KL to the
#: uncompressed model is at most a quarter of mlx-lm's 4-bit cache's on SmolLM2-135M at 2,048 tokens
#: (``rotation-3.5bit``; ``benchmarks/results/palu_frontier.json``)
DEFAULT_ROTATION_BITS = 3.5
#: the bits a rotation config may ask for, in halves from 2 to 8; a half codes keys with the bit above
#: and values with the bit below
ROTATION_BITS_ALLOWED: tuple[float, ...] = tuple(b / 2 for b in range(4, 17))


@dataclass(frozen=True)
class Rotation:
    """Code bits per rotated channel (:data:`ROTATION_BITS_ALLOWED`); checked by the config."""

    bits: float = DEFAULT_ROTATION_BITS

    @property
    def key_bits(self) -> int:
        """Bits per rotated key channel: a half rounds up for keys."""
        return int(-(-self.bits // 1))

    @property
    def value_bits(self) -> int:
        """Bits per rotated value channel: a half rounds down for values."""
        return int(self.bits // 1)
