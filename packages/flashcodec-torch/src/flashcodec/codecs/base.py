"""What every block codec shares: the block reshape along ``dim=-2`` and config validation.

A codec is a pure tensor map. It turns a sequence ``x [..., S, D]`` whose length is a
whole number of blocks (``S = n * r``) into a tuple of stored *parts*, each of shape
``[..., n, *part_shape]``, and back. A codec is a frozen dataclass whose fields are its options
(validated in ``__post_init__``): it is the configuration, never cache state, so one codec object
serves every layer, batch and device.

Every codec is linear along the sequence axis inside a block: a block of ``r`` tokens is
``block = A @ rows`` where ``rows [..., n, R, D]`` are the stored rows (see
:meth:`BlockCodec.stored_rows`) and ``A [r, R]`` is :meth:`BlockCodec.synthesis_matrix`.
That is what lets attention run on the stored rows directly: ``q . K[p] = (q . rows^T) @ A[p]``;
:meth:`BlockCodec.row_segments` hands the kernels those rows as stored, without decoding.

A new codec is one file defining a ``BlockCodec`` subclass plus one line in the registry
(``flashcodec.codecs.CODECS``); caches, the transformers backend and attention need no change.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError

from .parts import PartSpec, check_finite_part
from .tail import TailCoder, tail_coder

__all__ = [
    "PartSpec",
    "BlockCodec",
    "check_block_size",
    "check_finite_part",
    "to_blocks",
    "from_blocks",
    "to_output",
]


#: the largest symmetric int8 code (-128 is never written): ``flashcodec.codecs.quant.QMAX``
SYMMETRIC_INT8_MAX = 127


def check_block_size(block_size: object) -> int:
    """Validate ``block_size`` (an int >= 1) and return it."""
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise KVConfigError(f"block_size must be an integer >= 1; got {block_size!r}")
    return int(block_size)


def to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x [..., S, D]`` with ``S % r == 0`` -> ``[..., S // r, r, D]`` (a view when possible)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise KVDtypeError(f"codec input must be a floating-point torch.Tensor [..., S, D]; got {got}")
    if x.dim() < 2:
        raise KVShapeError(f"codec input must have at least 2 dims [..., S, D]; got shape {tuple(x.shape)}")
    s, d = x.shape[-2], x.shape[-1]
    if s % block_size:
        raise KVShapeError(
            f"codec input length S={s} (dim -2) must be a multiple of block_size={block_size}; "
            "the cache keeps the incomplete block raw"
        )
    return x.reshape(*x.shape[:-2], s // block_size, block_size, d)


def from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., n, r, D]`` -> ``[..., n * r, D]``."""
    *lead, n, r, d = blocks.shape
    return blocks.reshape(*lead, n * r, d)


def to_output(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (codec arithmetic, fp32 / fp64) cast to the output ``dtype``, saturating at its largest
    finite values: a lossy reconstruction can overshoot the input's range (truncation ringing, a
    rounded int8 / int4 coefficient), and an fp16 output must then read 65504, never inf."""
    if (
        dtype.is_floating_point
        and x.is_floating_point()
        and torch.finfo(dtype).max < torch.finfo(x.dtype).max
    ):
        info = torch.finfo(dtype)
        x = x.clamp(info.min, info.max)
    return x.to(dtype)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype codec arithmetic runs in: fp32 for fp16/bf16/fp32 inputs, fp64 stays fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class BlockCodec(ABC):
    """A linear, per-block transform along the sequence axis (``dim=-2``).

    Subclasses are frozen dataclasses: their fields are the codec's options (``block_size``
    first), checked and normalized in ``__post_init__``, and ``mode`` names the codec in the
    registry. Equality, hashing and ``repr`` come from the dataclass fields.
    """

    #: the codec's name in the registry (``flashcodec.codecs.CODECS``), e.g. ``"jpeg"``
    mode: ClassVar[str]
    #: tokens per block ``r``
    block_size: int
    #: whether packed int4 codes may be -8 (the nibble 0): symmetric codecs never write it, so a
    #: restored state holding one is refused (:meth:`check_part`); jpeg-int4z uses all 16 levels
    int4_zero_nibble: ClassVar[bool] = False
    #: whether :meth:`synthesis_matrix` is the identity (the stored rows are the tokens): the
    #: attention kernels then skip its product
    synthesis_is_identity: ClassVar[bool] = False
    #: newest tokens the cache keeps raw, uncoded: a block is coded once this many tokens follow
    #: it. 0 here (every complete block is coded); a codec with a ``raw_window`` field overrides it
    raw_window: int = 0
    #: how the tail (the incomplete block and the raw window) is stored: None = in the input dtype,
    #: 8 = int8 per token (:mod:`flashcodec.codecs.tail`); a codec with a ``window_bits`` field overrides it
    window_bits: int | None = None
    #: the sequence's first tokens a stream keeps apart, in the tail's form (:attr:`tail_coder`),
    #: once block 0 is archived: they replace block 0's first rows wherever tokens are read (an
    #: attention sink kept at the tail's precision). 0 here; a codec with a ``sink_tokens`` field
    #: overrides it
    sink_tokens: int = 0

    @property
    def value_codec(self) -> BlockCodec:
        """The codec of a cache's value stream: this codec itself, unless a codec codes keys and
        values differently (:class:`~flashcodec.codecs.KIVICodec`: keys per channel, values per
        token). It has this codec's ``block_size``, ``raw_window`` and ``window_bits``."""
        return self

    @property
    def tail_coder(self) -> TailCoder:
        """The :class:`~flashcodec.codecs.tail.TailCoder` for :attr:`window_bits`."""
        return tail_coder(self.window_bits)

    def sink_specs(self, dim: int) -> tuple[PartSpec, ...]:
        """The arrays of the sink a stream keeps apart (:attr:`sink_tokens`; none without one): the
        tail coder's parts, named ``sink_*``; the array for ``k`` tokens is ``[B, H, k, *shape]``."""
        if not self.sink_tokens:
            return ()
        return tuple(
            PartSpec("sink" + spec.name.removeprefix("tail"), spec.shape, spec.dtype)
            for spec in self.tail_coder.part_specs(dim)
        )

    def stream_state_specs(self, dim: int) -> tuple[PartSpec, ...]:
        """The arrays one stream's saved state holds, in order: the archive parts
        (:meth:`part_specs`, per block), the sink's (:meth:`sink_specs`, per token: ``sink_tokens``
        of them once a block is archived, else none), then the tail parts (:attr:`tail_coder`, per token)."""
        return (*self.part_specs(dim), *self.sink_specs(dim), *self.tail_coder.part_specs(dim))

    @property
    @abstractmethod
    def rows(self) -> int:
        """``R``, the number of stored rows per block (``block = A @ rows``)."""

    @property
    @abstractmethod
    def lossless(self) -> bool:
        """Whether decode(encode(x)) reproduces ``x`` (see the codec's docstring for how exactly)."""

    @abstractmethod
    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        """The stored arrays for a head dimension ``dim``, in the order :meth:`encode` returns them."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., n*r, D]`` -> parts, each ``[..., n, *spec.shape]`` (see :meth:`part_specs`)."""

    def encode_blocks(self, x: torch.Tensor, first_block: int) -> tuple[torch.Tensor, ...]:
        """:meth:`encode` for the blocks ``first_block, first_block + 1, ...`` of a stream (block 0
        starts at token 0): what a stream calls. :meth:`encode` here; a codec that treats the first
        tokens of a sequence apart (:class:`~flashcodec.codecs.KIVICodec`: the attention sink) overrides it."""
        return self.encode(x)

    @abstractmethod
    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """Parts for ``n`` blocks -> ``[..., n*r, D]`` in ``dtype``."""

    @abstractmethod
    def stored_rows(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """Parts for ``n`` blocks -> the dense rows ``[..., n, R, D]`` in ``dtype`` with ``block = A @ rows``."""

    @abstractmethod
    def synthesis_matrix(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """``A [r, R]``: the block of ``r`` tokens is ``A @ rows``."""

    def row_segments(
        self, parts: tuple[torch.Tensor, ...]
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """The stored rows as the attention kernels read them: ``(segments, scales)``.

        ``segments``: one or two tensors ``[..., n, R_i, D]`` whose rows, in order, are the
        ``R = sum R_i`` rows of each block, ideally views of ``parts`` (no copy, no decode);
        ``scales``: fp32 ``[..., n, R]`` multiplying each row, or None. This default returns
        :meth:`stored_rows` in fp32 (a copy); codecs override it to hand over their parts as stored.
        """
        return (self.stored_rows(parts, torch.float32),), None

    def row_offsets(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """fp32 ``[..., n, R]`` added to every element of each stored row after its scale (a zero
        point), or None (the default: rows are ``codes * scale`` only). The kernels add
        ``offset * sum(q)`` to a row's dot product and ``offset`` times the row's weight to the output."""
        return None

    def channel_affine(self, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp32 ``(scales, offsets)``, each ``[..., n, D]``, applied per channel to every token of a
        block after synthesis (``token = (A @ rows)[t] * scales[b] + offsets[b]``), or None (the
        default: no per-channel step; :class:`~flashcodec.codecs.ChannelInt4Codec` has one)."""
        return None

    def channel_rotation(self, dim: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """``M`` fp32 ``[dim, dim]`` (orthonormal) when the stored rows hold each token ``x`` as
        ``x @ M`` (:mod:`flashcodec.codecs.rotated`), else None (the default: the token's own
        channels). The attention kernels rotate the query and the output to match."""
        return None

    def check_parts(self, parts: object) -> None:
        """``KVShapeError`` unless ``parts`` is a tuple / list of as many tensors as :meth:`encode`
        returns (what :meth:`decode`, :meth:`stored_rows` and :meth:`row_segments` take)."""
        specs = self.part_specs(1)
        if (
            not isinstance(parts, (tuple, list))
            or len(parts) != len(specs)
            or not all(isinstance(p, torch.Tensor) for p in parts)
        ):
            names = ", ".join(spec.name for spec in specs)
            got = f"{len(parts)} items" if isinstance(parts, (tuple, list)) else type(parts).__name__
            raise KVShapeError(
                f"{self.mode} codec parts must be {len(specs)} tensor(s) ({names}) as encode returns them; got {got}"
            )

    def check_stored(self, parts: tuple[torch.Tensor, ...], *, check_finite: bool = True) -> None:
        """``KVDataError`` naming the part when ``parts`` (shaped as :meth:`part_specs` says; a
        restored state's) hold values this codec never writes. Reads only.

        Calls :meth:`check_part` on each part. ``check_finite``: NaN / inf in parts of the input
        dtype are refused too (scales and zero points always are)."""
        for spec, part in zip(self.part_specs(1), parts, strict=True):
            if part.numel():
                self.check_part(spec, part, check_finite=check_finite)

    def check_part(self, spec: PartSpec, part: torch.Tensor, *, check_finite: bool) -> None:
        """What every codec here writes: finite values (:func:`check_finite_part`), scales >= 0, int8 codes in ``-QMAX..QMAX`` (symmetric; -128 never
        occurs), packed int4 codes stored as ``q + 8`` in ``1..15`` unless
        :attr:`int4_zero_nibble`. A codec whose parts hold something else overrides this."""
        check_finite_part(spec, part, check_finite=check_finite)
        if part.dtype == torch.int8 and int(part.min()) < -SYMMETRIC_INT8_MAX:
            raise KVDataError(
                f"part {spec.name!r} holds the int8 code -128; codes lie in "
                f"-{SYMMETRIC_INT8_MAX}..{SYMMETRIC_INT8_MAX}"
            )
        if part.dtype == torch.uint8 and not self.int4_zero_nibble:
            # int4 codes q in -7..7 are stored as q + 8 (1..15); an odd D pads with 8, so 0 never occurs
            if bool(((part & 15) == 0).any()) or bool(((part >> 4) == 0).any()):
                raise KVDataError(
                    f"part {spec.name!r} holds a 0 nibble; packed int4 codes are stored as 1..15"
                )

    def check_dim(self, dim: int) -> None:
        """Raise ``KVShapeError`` when this codec cannot store rows of head dimension ``dim``.

        Every ``dim >= 1`` by default; the caches call it before the first append changes anything.
        """
        return None

    def config(self) -> dict:
        """``mode`` plus every field: the keywords that rebuild this codec through
        :func:`flashcodec.codecs.make_codec` (dtypes given by name, so every value prints plainly)."""
        out: dict = {"mode": self.mode}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            out[field.name] = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
        return out

    def canonical(self, x: torch.Tensor) -> torch.Tensor:
        """The input as this codec reproduces it at best; the cache stores tail tokens this way too.

        Identity here; a codec that cannot carry some bit patterns (png: the sign of a zero)
        maps them to the value it will return, so raw tail tokens and archived tokens agree.
        """
        return x

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))`` in ``x``'s dtype; ``x [..., n*r, D]``."""
        return self.decode(self.encode(x), x.dtype)

    def storage_ratio(self, dim: int, dtype: torch.dtype) -> float:
        """Formula (not a measurement): archive bytes per block / raw bytes per block.

        Measured figures come from the arrays a cache holds (``CodecKVCache.storage_bytes``).
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        stored = 0
        for spec in self.part_specs(dim):
            part_dtype = spec.dtype or dtype
            stored += math.prod(spec.shape) * torch.empty((), dtype=part_dtype).element_size()
        return stored / (self.block_size * dim * itemsize)
