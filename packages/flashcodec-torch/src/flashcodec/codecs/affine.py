"""What the codecs whose stored rows are asymmetric codes (``code * scale + zero``) share.

A codec here stores, per block, one array of codes and an fp16 scale and zero point either per
channel (``[1, D]``: :class:`~flashcodec.codecs.ChannelInt4Codec`, the keys of the KIVI codecs) or
per stored row (``[R, 1]``: :class:`~flashcodec.codecs.ZeroPointJPEGCodec`, the values of the KIVI
codecs). :class:`ChannelAffine` and :class:`RowAffine` hand those to the attention kernels;
:class:`TokenRows` is a codec whose stored rows are the block's tokens (``A`` the identity).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch
from kvspec import KVShapeError

from .base import BlockCodec, PartSpec, from_blocks, to_output

__all__ = [
    "AffineCodes",
    "TokenRows",
    "ChannelAffine",
    "RowAffine",
    "channel_affine_specs",
    "row_affine_specs",
    "check_even",
]


def channel_affine_specs(codes: PartSpec, dim: int) -> tuple[PartSpec, ...]:
    """``(codes, scales [1, D] fp16, zeros [1, D] fp16)``: a scale and zero point per channel."""
    return codes, PartSpec("scales", (1, dim), torch.float16), PartSpec("zeros", (1, dim), torch.float16)


def row_affine_specs(codes: PartSpec, rows: int) -> tuple[PartSpec, ...]:
    """``(codes, scales [R, 1] fp16, zeros [R, 1] fp16)``: a scale and zero point per stored row."""
    return codes, PartSpec("scales", (rows, 1), torch.float16), PartSpec("zeros", (rows, 1), torch.float16)


def check_even(mode: str, dim: int) -> None:
    """``KVShapeError`` when packed int4 codes (two a byte along ``D``) cannot hold ``dim`` channels."""
    if dim % 2:
        raise KVShapeError(f"{mode} packs two int4 codes a byte along D: D must be even; got D={dim}")


class TokenRows(BlockCodec):
    """A lossy codec whose stored rows are the block's tokens: ``R = r`` and ``A`` the identity, so
    the kernels skip the synthesis product. :meth:`decode` is :meth:`stored_rows` in fp32 through
    :meth:`_unrotate` (the identity here; a codec storing ``x @ M`` turns the rows back)."""

    synthesis_is_identity: ClassVar[bool] = True

    @property
    def rows(self) -> int:
        return self.block_size

    @property
    def lossless(self) -> bool:
        return False

    def synthesis_matrix(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """The identity ``[r, r]``: the stored rows are the block's tokens."""
        return torch.eye(self.block_size, dtype=dtype, device=device)

    def _unrotate(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """Parts for ``n`` blocks -> the tokens ``[..., n*r, D]`` in ``dtype``."""
        return to_output(from_blocks(self._unrotate(self.stored_rows(parts, torch.float32))), dtype)


class AffineCodes(BlockCodec):
    """Parts ``(codes, scales, zeros, ...)``: :meth:`stored_rows` is :meth:`_dequantize` after the
    check, the kernels read the codes as :meth:`_kernel_codes` gives them (as stored, here) and the
    scales and zero points as :meth:`_side` gives them (the fp16 parts in fp32, here)."""

    def _side(self, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(scales, zeros)`` shaped as stored (``[..., n, 1, D]`` or ``[..., n, R, 1]``);
        a codec storing them in fewer bits (:mod:`flashcodec.codecs.rotated`) expands them here."""
        return parts[1].float(), parts[2].float()

    def _side_scales(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The scales of :meth:`_side` alone, for a reader that needs no zero points."""
        return parts[1].float()

    @abstractmethod
    def _dequantize(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """``codes * scale + zero`` ``[..., n, R, D]`` in ``dtype``, for checked ``parts``."""

    def _kernel_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return codes

    def stored_rows(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """The stored rows ``[..., n, R, D]`` in ``dtype``: codes times their scale plus their zero point."""
        self.check_parts(parts)
        return self._dequantize(parts, dtype)


class ChannelAffine(AffineCodes):
    """Parts ``(codes, scales [1, D], zeros [1, D])``: the per-channel step goes to the kernels."""

    def row_segments(
        self, parts: tuple[torch.Tensor, ...]
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """``((codes,), None)``: no row scale (see :meth:`channel_affine`)."""
        self.check_parts(parts)
        return (self._kernel_codes(parts[0]),), None

    def channel_affine(self, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp32 ``(scales, zeros)``, each ``[..., n, D]``: token ``t`` of block ``b`` is
        ``(A @ rows)[t] * scales[b] + zeros[b]``."""
        self.check_parts(parts)
        scales, zeros = self._side(parts)
        return scales[..., 0, :], zeros[..., 0, :]


class RowAffine(AffineCodes):
    """Parts ``(codes, scales [R, 1], zeros [R, 1])``: each stored row's scale and zero point go to the kernels."""

    def row_segments(
        self, parts: tuple[torch.Tensor, ...]
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """``((codes,), fp32 scales [..., n, R])``; the zero points are :meth:`row_offsets`."""
        self.check_parts(parts)
        return (self._kernel_codes(parts[0]),), self._side_scales(parts)[..., 0]

    def row_offsets(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """fp32 ``[..., n, R]``: the zero point added to every element of each stored row."""
        self.check_parts(parts)
        return self._side(parts)[1][..., 0]
