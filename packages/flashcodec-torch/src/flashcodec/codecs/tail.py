"""How a stream stores its tail (the tokens not yet coded in blocks): raw, or int8 per token.

The tail holds the incomplete block and, for a codec with a ``raw_window``, the newest
``raw_window`` tokens too. Raw (the default) keeps them in the input dtype, bit for bit. With
``window_bits=8`` (:class:`~flashcodec.codecs.ZeroPointJPEGCodec`) each tail token is stored as
``D`` uint8 codes with an fp32 scale and zero point of its own (asymmetric, 256 levels over the
token's ``[min, max]`` along ``D``): 8 bits an element plus 64 bits a token for the two fp32
values (9 bits an element at ``D = 64``), against 16 in bf16, so a window costs a little over half
its bf16 bytes. The metadata is fp32 so that no bf16 value overflows it.

A tail coder is a pure tensor map over ``[B, H, t, D]`` (one token at a time: tokens are
independent, so slicing, concatenating and gathering the stored parts along ``dim=2`` is the
same as doing so to the tokens). Readers call :meth:`TailCoder.decode`; attention kernels get
the decoded tail (fewer than ``r + raw_window`` tokens) and need no change.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from kvspec import KVConfigError

from .parts import PartSpec, check_finite_part

__all__ = [
    "TailCoder",
    "RawTail",
    "Uint8Tail",
    "tail_coder",
    "check_window_options",
    "set_window_fields",
    "TAIL_BITS",
]

#: the ``window_bits`` values a codec accepts: None (raw) or 8
TAIL_BITS = (None, 8)

#: int8 tail: codes 0..255
_LEVELS = 255
_TINY = torch.finfo(torch.float32).tiny


class TailCoder(ABC):
    """Stored parts per tail token (``part_specs``), and the maps between tokens and parts."""

    @abstractmethod
    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        """One :class:`PartSpec` per stored array; the array for ``t`` tokens is ``[B, H, t, *shape]``."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tokens ``[B, H, t, D]`` -> the stored parts."""

    @abstractmethod
    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """The stored parts -> tokens ``[B, H, t, D]`` in ``dtype``."""

    def check_stored(self, parts: tuple[torch.Tensor, ...], *, check_finite: bool = True) -> None:
        """``KVDataError`` naming the part when the stored tail ``parts`` hold what this coder never
        writes: NaN / inf (raw tokens only when ``check_finite``; a coded tail's metadata always),
        a negative scale. Reads only."""
        for spec, part in zip(self.part_specs(1), parts, strict=True):
            if part.numel():
                check_finite_part(spec, part, check_finite=check_finite or spec.dtype is not None)


@dataclass(frozen=True)
class RawTail(TailCoder):
    """The tokens as given, in the input dtype: ``decode`` returns the stored tensor itself."""

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        return (PartSpec("tail", (dim,), None),)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x,)

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return parts[0]


@dataclass(frozen=True)
class Uint8Tail(TailCoder):
    """Asymmetric int8 per token: ``x ~ codes * scale + zero`` with ``scale = (max - min) / 255``
    and ``zero = min`` over the token's ``D`` values (fp32); a constant token gets scale 0."""

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        return (
            PartSpec("tail_codes", (dim,), torch.uint8),
            PartSpec("tail_scales", (1,), torch.float32),
            PartSpec("tail_zeros", (1,), torch.float32),
        )

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # few ops: this runs for every stream at every decode step
        xf = x.float()
        lo, hi = torch.aminmax(xf, dim=-1, keepdim=True)
        scale = (hi - lo) / _LEVELS
        # a constant token (scale 0) divides 0 by the smallest normal float: code 0, exact
        codes = ((xf - lo) / scale.clamp_min(_TINY)).round_().clamp_(0, _LEVELS).to(torch.uint8)
        return codes, scale, lo

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        codes, scale, zero = parts
        return torch.addcmul(zero, codes.float(), scale).to(dtype)


#: one shared coder per ``window_bits`` (coders hold no state; streams ask for theirs at every step)
_CODERS: dict[int | None, TailCoder] = {None: RawTail(), 8: Uint8Tail()}


def tail_coder(window_bits: int | None) -> TailCoder:
    """The coder for a codec's ``window_bits`` (validated by the codec: one of :data:`TAIL_BITS`)."""
    return _CODERS[window_bits]


def check_window_options(raw_window: object, window_bits: object) -> tuple[int, int | None]:
    """``(raw_window, window_bits)`` normalized, for a codec's ``__post_init__``; ``KVConfigError``
    saying what is allowed when ``raw_window`` is not an integer >= 0 or ``window_bits`` not one
    of :data:`TAIL_BITS`."""
    if isinstance(raw_window, bool) or not isinstance(raw_window, numbers.Integral) or raw_window < 0:
        raise KVConfigError(f"raw_window must be an integer >= 0 (tokens kept raw); got {raw_window!r}")
    bits = window_bits
    if bits is not None and (
        isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or bits not in TAIL_BITS
    ):
        raise KVConfigError(
            f"window_bits must be one of {TAIL_BITS} (None: the tail in the input dtype); got {bits!r}"
        )
    return int(raw_window), None if bits is None else int(bits)


def set_window_fields(codec: object) -> None:
    """A frozen codec's ``raw_window`` and ``window_bits`` fields checked (:func:`check_window_options`)
    and normalized in place: for its ``__post_init__``."""
    raw_window, window_bits = check_window_options(codec.raw_window, codec.window_bits)
    object.__setattr__(codec, "raw_window", raw_window)
    object.__setattr__(codec, "window_bits", window_bits)
