"""Fixed scalar quantizers per latent channel, packed into whole bytes per token and head.

A channel of variance ``σ²`` coded at ``b`` bits is a midrise uniform quantizer with ``2^b``
levels and step ``Δ_b σ``, where ``Δ_b`` (:data:`GAUSSIAN_STEP`) is the step that minimises the
mean-squared error of a unit Gaussian (Max, 1960); codes outside the range clip to the end levels,
or, with a per-token scale (:func:`token_scales`), the steps of a row stretch so none of its
channels of 2 bits or more clips. Both the calibrated cache (steps from a calibration file) and
the prefill-fitted cache (steps from the fit tokens' variance) code with :class:`FixedQuantCoder`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError

from ..mixed_bit import Segment

__all__ = [
    "GAUSSIAN_STEP",
    "TOKEN_SCALE_BYTES",
    "SCALE_BITS",
    "scale_bytes",
    "store_scales",
    "read_scales",
    "token_scales",
    "FixedQuantCoder",
]

#: MSE-optimal uniform quantizer step (in standard deviations) for a unit Gaussian, 2^b levels.
GAUSSIAN_STEP: dict[int, float] = {
    1: 1.596,
    2: 0.9957,
    3: 0.586,
    4: 0.3352,
    5: 0.1881,
    6: 0.1041,
    7: 0.0569,
    8: 0.0308,
}


#: bytes of the per-token scale a :class:`FixedQuantCoder` with ``token_scale`` puts in front of
#: each row (one bfloat16: float16 would overflow on inputs far larger than the fit's)
TOKEN_SCALE_BYTES = 2

#: widths a per-token scale can be stored at: 16 (bfloat16) or 8 (a log code, :func:`store_scales`)
SCALE_BITS: tuple[int, ...] = (16, 8)
#: the 8-bit log code: code ``c`` is the scale ``2^((c - _LOG_ZERO) / _LOG_STEPS)``, 2^-5 to 2^11
#: in steps of 1/16 octave (4.4%)
_LOG_STEPS = 16
_LOG_ZERO = 80


def scale_bytes(scale_bits: int) -> int:
    """Bytes of one stored per-token scale of ``scale_bits`` (16: :data:`TOKEN_SCALE_BYTES`, 8: 1)."""
    if scale_bits not in SCALE_BITS:
        raise KVConfigError(f"scale_bits={scale_bits!r} must be one of {SCALE_BITS}")
    return TOKEN_SCALE_BYTES if scale_bits == 16 else 1


def store_scales(scale: mx.array, scale_bits: int) -> mx.array:
    """Per-token scales ``[..., 1]`` float32 -> their stored bytes ``[..., scale_bytes]`` uint8.

    16 bits: the bfloat16 nearest the scale. 8 bits: the smallest log code whose scale is at least
    the given one (rounded up, so a row quantized against it still does not clip), clamped to
    the code's range: a scale below 2^-5 stores 2^-5 (a coarser step for a token of tiny latents),
    one above 2^11 clips its row.
    """
    if scale_bits == 16:
        return scale.astype(mx.bfloat16).view(mx.uint8)
    code = mx.ceil(mx.log2(mx.maximum(scale, 2.0**-100)) * _LOG_STEPS - 1e-4) + _LOG_ZERO
    return mx.clip(code, 0, 255).astype(mx.uint8)


def read_scales(stored: mx.array, scale_bits: int) -> mx.array:
    """Stored scale bytes ``[..., scale_bytes]`` uint8 -> scales ``[..., 1]`` float32 (:func:`store_scales`)."""
    if scale_bits == 16:
        return mx.contiguous(stored).view(mx.bfloat16).astype(mx.float32)
    return mx.power(2.0, (stored.astype(mx.float32) - _LOG_ZERO) / _LOG_STEPS)


def token_scales(normalized: mx.array, half_levels: mx.array, wide: mx.array) -> mx.array:
    """Per-token scale of latents already divided by their channel steps: ``[..., r]`` -> ``[..., 1]``.

    The scale is the smallest factor that keeps every channel of at least 2 bits inside its
    quantizer's range (``half_levels`` steps either side of zero), so no such channel clips:
    held-out latents reach 6-8 standard deviations of the fit tokens' spread (attention sinks,
    huge-norm tokens), far outside a fixed range fitted on the typical tokens. 1-bit channels
    are left out: their quantizer is a sign, clipping by design; a row of 1-bit channels only
    keeps scale 1 (the coder stores 1 without calling this). Floored at 2^-100 so an all-zero
    token decodes to zeros instead of dividing by zero.
    """
    ratio = mx.abs(normalized) / half_levels
    ratio = mx.where(wide, ratio, 0.0)
    # the 2^-7 nudge makes the bfloat16 the scale is stored in round up, so the largest channel
    # stays inside the range even at 8 bits
    return mx.maximum(mx.max(ratio, axis=-1, keepdims=True), 2.0**-100) * (1.0 + 2.0**-7)


@dataclass(frozen=True)
class FixedQuantCoder:
    """Per-channel uniform quantizers and a whole-byte bitstream per token and head.

    Attributes:
        widths: ``r`` ints in ``[1, 8]``, the bits of each latent channel (shared by the heads).
        steps: ``[H, r]`` float32 quantizer steps per head and channel.
        token_scale: False: the steps are fixed, latents outside the range clip to the end levels,
            and a row holds only the codes. True: each token and head also stores one bfloat16 scale
            (:func:`token_scales`, the first :data:`TOKEN_SCALE_BYTES` bytes of its row) that
            multiplies every step of that row, chosen so that no channel of 2 bits or more clips.
        scale_bits: how that scale is stored: 16, a bfloat16; 8, one byte of a log code in steps
            of 1/16 octave (:func:`store_scales`), rounded up so that nothing clips either: steps
            up to 4.4% coarser, for one byte less per token and head.
    """

    widths: tuple[int, ...]
    steps: mx.array
    token_scale: bool = False
    scale_bits: int = 16

    def __post_init__(self) -> None:
        if not self.widths or any(not 1 <= w <= 8 for w in self.widths):
            raise KVConfigError(f"widths={self.widths!r} must be a non-empty list of ints in [1, 8]")
        if not isinstance(self.token_scale, bool):
            raise KVConfigError(f"token_scale={self.token_scale!r} must be True or False")
        if isinstance(self.scale_bits, bool) or self.scale_bits not in SCALE_BITS:
            raise KVConfigError(f"scale_bits={self.scale_bits!r} must be one of {SCALE_BITS}")

    @property
    def rank(self) -> int:
        return len(self.widths)

    @property
    def bits_per_row(self) -> int:
        """Code bits of one token and head (the scale, if any, not counted)."""
        return sum(self.widths)

    @property
    def code_bytes(self) -> int:
        """Bytes of the codes of one token and head: ``ceil(sum(widths) / 8)``."""
        return -(-self.bits_per_row // 8)

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one token and head: the codes, plus the bfloat16 scale with ``token_scale``."""
        return self.code_bytes + (self.scale_bytes if self.token_scale else 0)

    @property
    def scale_bytes(self) -> int:
        """Bytes of the per-token scale in front of a row with :attr:`token_scale`."""
        return scale_bytes(self.scale_bits)

    def filled(self) -> FixedQuantCoder:
        """This coder with the bits that only round a row up to whole bytes given to its channels.

        A row of ``sum(widths)`` code bits takes :attr:`code_bytes` whole bytes, so up to 7 bits of
        each row are padding. Here they go, one at a time, to the channel whose error the next bit
        cuts most (variance times ``4^-width``, water-filling's own rule, with each channel's
        variance read back from its step: ``step / GAUSSIAN_STEP[width]``, averaged over the heads),
        and the steps follow the new widths. The rows keep their bytes; their error drops. Channels
        the fit dropped (0 bits) stay dropped: the projection holds no column for them.
        """
        spare = 8 * self.code_bytes - self.bits_per_row
        widths = np.array(self.widths, dtype=np.int64)
        if not spare or bool(np.all(widths >= 8)):
            return self
        sigma = np.array(self.steps, dtype=np.float64) / np.array([GAUSSIAN_STEP[int(w)] for w in widths])
        lam = (sigma**2).mean(axis=0)
        for _ in range(spare):
            gain = np.where(widths < 8, lam * 4.0**-widths, -1.0)
            c = int(np.argmax(gain))
            if gain[c] <= 0:
                break
            widths[c] += 1
        steps = sigma * np.array([GAUSSIAN_STEP[int(w)] for w in widths])
        return FixedQuantCoder(
            tuple(int(w) for w in widths),
            mx.array(steps.astype(np.float32)),
            self.token_scale,
            self.scale_bits,
        )

    @cached_property
    def _layout(self) -> tuple[mx.array, ...]:
        """Per channel: first byte, bit shift inside it, mask, levels, and whether a token scale
        covers it.

        A code of at most 8 bits starting at stream bit ``o`` lies in bytes ``o // 8`` and
        ``o // 8 + 1``, so encoding adds its low and high parts into those two bytes and
        decoding reads those two bytes: work per channel, never per bit. These stay with the
        coder for every step, so they are vectors of ``rank``; the channel-to-byte matrix
        encoding needs is built per call (:meth:`_byte_onehot`).
        """
        start = np.concatenate([[0], np.cumsum(self.widths)[:-1]])
        return (
            mx.array((start // 8).astype(np.int32)),
            mx.array((start % 8).astype(np.uint32)),
            mx.array([(1 << w) - 1 for w in self.widths], dtype=mx.uint32),
            mx.array([1 << w for w in self.widths], dtype=mx.float32),
            mx.array([w >= 2 for w in self.widths]),
        )

    def _byte_onehot(self, first: mx.array) -> mx.array:
        """``[rank, code_bytes + 1]`` float32: 1 where channel ``c`` starts in byte ``first[c]``."""
        return (first[:, None] == mx.arange(self.code_bytes + 1)[None, :]).astype(mx.float32)

    # -- the latent-coder interface the caches use (palu_mlx.coders.base.LatentCoder)
    #: every channel is quantized
    quantizes = True

    @property
    def assigned_avg_bits(self) -> float:
        """Mean code bits per latent channel (the per-token scale not counted)."""
        return self.bits_per_row / self.rank

    @property
    def fixed_widths(self) -> tuple[int, ...]:
        """The width of each latent channel (:attr:`widths`)."""
        return self.widths

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The widths as runs of equal width (the layout a state records beside them)."""
        runs: list[Segment] = []
        for i, b in enumerate(self.widths):
            if runs and runs[-1].bits == b:
                runs[-1] = Segment(runs[-1].start, i + 1, b)
            else:
                runs.append(Segment(i, i + 1, b))
        return tuple(runs)

    def field_widths(self) -> dict[str, tuple[int, mx.Dtype]]:
        """One field: ``codes``, :attr:`bytes_per_row` uint8 per token and head."""
        return {"codes": (self.bytes_per_row, mx.uint8)}

    def encode_fields(self, latents: mx.array) -> dict[str, mx.array]:
        """:meth:`encode` as ``{"codes": rows}``."""
        return {"codes": self.encode(latents)}

    def decode_fields(self, fields: dict[str, mx.array]) -> mx.array:
        """:meth:`decode` of ``fields["codes"]``."""
        return self.decode(fields["codes"])

    def constants(self) -> dict[str, mx.array]:
        """Arrays held once beside the codes: the quantizer ``steps`` ``[H, r]``."""
        return {"steps": self.steps}

    def encode(self, latents: mx.array) -> mx.array:
        """Latents ``[B, H, S, r]`` -> packed rows ``[B, H, S, bytes_per_row]`` uint8."""
        first, shift, _, levels, wide = self._layout
        u = latents.astype(mx.float32) / self.steps[None, :, None, :]
        scale_bytes = None
        if self.token_scale:
            # quantize against the stored scale, so decoding sees the same number
            if any(w >= 2 for w in self.widths):
                scale = token_scales(u, levels / 2, wide)
            else:  # only 1-bit channels: nothing to keep in range, the fixed steps stand
                scale = mx.ones((*u.shape[:-1], 1), dtype=mx.float32)
            scale_bytes = store_scales(scale, self.scale_bits)
            u = u / read_scales(scale_bytes, self.scale_bits)
        q = mx.floor(u + levels / 2)
        q = mx.clip(q, 0, levels - 1).astype(mx.uint32) << shift
        # the fields of one byte are disjoint, so their float32 sum (< 256) is their bitwise OR;
        # a channel's high part lands one byte after its low part
        onehot = self._byte_onehot(first)
        lo = (q & 0xFF).astype(mx.float32) @ onehot
        hi = (q >> 8).astype(mx.float32) @ onehot
        hi = mx.concatenate([mx.zeros_like(hi[..., :1]), hi[..., : self.code_bytes - 1]], axis=-1)
        codes = (lo[..., : self.code_bytes] + hi).astype(mx.uint8)
        return codes if scale_bytes is None else mx.concatenate([scale_bytes, codes], axis=-1)

    def decode(self, packed: mx.array) -> mx.array:
        """Packed rows ``[B, H, S, bytes_per_row]`` -> latents ``[B, H, S, r]`` float32."""
        first, shift, mask, levels, _ = self._layout
        scale = None
        if self.token_scale:
            scale = read_scales(packed[..., : self.scale_bytes], self.scale_bits)
            packed = packed[..., self.scale_bytes :]
        b = mx.concatenate([packed, mx.zeros((*packed.shape[:-1], 1), dtype=mx.uint8)], axis=-1).astype(
            mx.uint32
        )
        pair = mx.take(b, first, axis=-1) | (mx.take(b, first + 1, axis=-1) << 8)
        codes = ((pair >> shift) & mask).astype(mx.float32)
        steps = self.steps[None, :, None, :]
        if scale is not None:
            steps = steps * scale
        return (codes + 0.5 - levels / 2) * steps
