"""KIVI's split after a fixed rotation of each head's channels (QuaRot, TurboQuant), at 2 to 8 bits.

A real model's keys carry a few outlier channels, and a token's values a few large entries. An
orthonormal rotation ``M [D, D]`` of the channels spreads them over all ``D`` channels, so a
quantization group (a channel along a block of keys, or one token of values) meets a flatter
range; ``M`` needs no data: ``M = diag(s) H / sqrt(D)`` with ``H`` the Sylvester Hadamard matrix and
``s`` seeded random signs (:func:`hadamard_rotation`; where ``D`` is not a power of two, a seeded
random orthogonal matrix). The codes are then
KIVI's (:mod:`flashcodec.codecs.kivi`): keys per (block, channel), values per token, asymmetric with
fp16 scales and zero points, and the first key of the sequence stored exactly (as the zero points
of block 0) in the rotated basis.

Attention stays on the codes, because a rotation preserves dot products: ``q . k = (q M) . (k M)``
and ``sum p v = (sum p (v M)) M^T``. The kernels get ``M`` in
:attr:`flashcodec.kernels.naive.CodedRows.rotation`: the torch reference rotates the query once
for the archived blocks and turns the archived blocks' part of the output back; the raw (or int8)
tail holds the tokens as they came, unrotated. The materialized path just decodes:
:meth:`RotatedKIVICodec.decode` returns the tokens in their own channels.

Stored parts per block (``b`` bits: 2, 3, 4 or 8), in the rotated basis:

* keys: ``codes [r, W]``, ``scales [1, D]`` fp16, ``zeros [1, D]`` fp16 (per channel);
* values: ``codes [r, W]``, ``scales [r, 1]`` fp16, ``zeros [r, 1]`` fp16 (per token);

with ``W`` bytes a token: ``D / 4`` (2 bits, four codes a byte), ``3 D / 8`` (3 bits, eight codes in
three bytes), ``D / 2`` (4 bits, packed as the package's int4) or ``D`` (8 bits, int8). At
``r = 64`` and ``D = 64`` each side costs ``b + 0.5`` bits an element.

With ``side_bits=8`` the side information costs half: at 2-3 bits an fp16 scale and zero point
per 64 values are a sixth of the bytes, yet they need far less precision than fp16. Each scale is
an 8-bit code ``u`` of ``base * 2**(-u / 16)`` (rounded up, so the levels still reach both ends of
the slice), ``base`` one fp16 value per block (part ``scale_base [1, 1]``, the block's largest
scale); each zero point an int8 number of half steps (``zero = z * scale / 2``; a slice whose
middle lies beyond 127 half steps from 0 gets a coarser step). The keys' zero points stay fp16
under ``exact_sink`` (they hold the first key). The kernels read the scales and zero points
expanded to fp32 (:meth:`~flashcodec.codecs.affine.AffineCodes._side`), as they read the fp16 ones. 4- and 8-bit codes are read by
the kernels as stored; 2- and 3-bit codes are widened to int8 codes for them (a transient copy of
one byte an element per call: the kernels read only int8 and packed int4 rows).

``value_sink_tokens=k`` keeps the values of the sequence's first ``k`` tokens apart from block 0,
in the int8 window's form (the value stream's sink, :mod:`flashcodec.stream`): with
``exact_sink`` the attention sink's key is exact, and its value, which a sink token passes on to
every query that attends to it, keeps 8 bits instead of 2-4. Block 0 still codes all its tokens,
so the parts keep their shape; the sink costs ``k`` int8 tokens a head.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch
from kvspec import KVConfigError, KVDataError, KVShapeError

from .affine import ChannelAffine, RowAffine, TokenRows, channel_affine_specs, row_affine_specs
from .base import PartSpec, check_block_size, to_blocks
from .kivi import check_bits, dequantize_zero, encode_with_sink, quantize_zero
from .quant import _pack_int4, packed_width, unpack_int4
from .tail import set_window_fields

__all__ = [
    "ROTATED_BITS",
    "SIDE_BITS",
    "SCALE_LOG_STEPS",
    "RANGE_FITS",
    "RotatedKIVICodec",
    "RotatedTokenIntCodec",
    "hadamard_rotation",
    "pack_codes",
    "unpack_codes",
    "quantize_bits",
    "dequantize_bits",
    "quantize_side8",
    "side8_values",
]

#: the code widths the rotated codecs store
ROTATED_BITS = (2, 3, 4, 8)
#: (lowest code, highest code) per width (asymmetric; int8 leaves -128 unused, as every int8 code here)
_CODE_RANGE = {2: (-2, 1), 3: (-4, 3), 4: (-8, 7), 8: (-127, 127)}
#: channels one packed group holds: four 2-bit codes a byte, eight 3-bit codes in three bytes
_GROUP = {2: 4, 3: 8, 4: 2, 8: 1}
_FP16_MAX = float(torch.finfo(torch.float16).max)
_TINY = float(torch.finfo(torch.float32).tiny)
#: how a slice's codes are fitted: its [min, max] (every element within half a step), or the step
#: of the best uniform quantizer of a Gaussian of the slice's mean and standard deviation (Max,
#: 1960), clipping its tails: after a rotation a slice is close to Gaussian, and at 2 bits min-max
#: spends its four levels on the two extremes of 64 samples
RANGE_FITS = ("minmax", "gauss")
#: that step in standard deviations, per code width (4, 8 and 16 levels)
_GAUSS_STEP = {2: 0.9957, 3: 0.5860, 4: 0.3352}
#: how a codec stores its scales and zero points: fp16 each (16), or 8-bit codes (8, see above)
SIDE_BITS = (16, 8)
#: an 8-bit scale code ``u`` stands for ``base * 2**(-u / SCALE_LOG_STEPS)``: levels 4.4% apart
#: (a scale rounded up by at most that), over 16 octaves below the block's largest scale
SCALE_LOG_STEPS = 16
#: the largest zero point in half steps: int8 (-127..127; -128 unused, as every int8 code here), or
#: a nibble (-7..7, stored + 8 in 1..15, two rows a byte) for ``zero_bits=4``
_ZERO_MAX = {8: 127, 4: 7}


def _check_bits(name: str, bits: object) -> int:
    return check_bits(name, bits, ROTATED_BITS)


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise KVConfigError(f"{name} must be a bool; got {value!r}")
    return value


# --------------------------------------------------------------------------- the rotation
@lru_cache(maxsize=32)
def _rotation(dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dim & (dim - 1):
        # no Hadamard matrix of this order (head sizes such as 80 or 96): a random orthogonal
        # matrix, the Q of a seeded Gaussian's QR with its signs fixed, spreads outliers alike
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).to(torch.float32)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (dim, 1), generator=g, dtype=torch.float64) * 2 - 1
    return (signs * h / math.sqrt(dim)).to(torch.float32)


@lru_cache(maxsize=32)
def _rotation_on(dim: int, seed: int, device: torch.device) -> torch.Tensor:
    # one copy per device: the kernels ask for the rotation at every decode step of every layer
    return _rotation(dim, seed).to(device)


def hadamard_rotation(dim: int, seed: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """The fixed rotation ``M = diag(s) H / sqrt(D)``: fp32 ``[D, D]``, orthonormal (``M M^T = I``).

    ``H`` is the Sylvester Hadamard matrix of order ``D`` and ``s`` a vector of random signs drawn
    from ``seed``; where ``D`` is not a power of two (no such ``H``), ``M`` is a random orthogonal
    matrix drawn from ``seed`` instead. A token ``x [..., D]`` is stored as
    ``x @ M`` and read back as ``(x @ M) @ M.T``. Built once per ``(dim, seed)``; each call returns
    a copy (on ``device``), so no caller can change the cached one.
    """
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 1:
        raise KVShapeError(f"hadamard_rotation: dim must be a positive integer; got {dim!r}")
    return _rotation(int(dim), int(seed)).to(device, copy=True)


# --------------------------------------------------------------------------- codes
def code_width(bits: int, dim: int) -> int:
    """Bytes of ``dim`` codes of ``bits`` bits (``dim`` a multiple of :data:`_GROUP`, checked by the codec)."""
    if bits == 8:
        return dim
    if bits == 4:
        return packed_width(dim)
    return dim * bits // 8


def _check_packable(mode: str, name: str, bits: int, dim: int) -> None:
    group = _GROUP[bits]
    if dim % group:
        raise KVShapeError(
            f"{mode} packs {group} {bits}-bit codes together along D ({name}={bits}): D must be a "
            f"multiple of {group}; got D={dim}"
        )


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes ``q [..., D]`` in :data:`_CODE_RANGE` of ``bits`` (2 or 3) -> uint8 ``[..., W]``.

    2 bits: ``q + 2`` in the four 2-bit fields of a byte, channel ``4i + j`` at bits ``2j``.
    3 bits: each eight channels ``8i .. 8i + 7`` as ``q + 4`` in the 3-bit fields of a 24-bit word
    (channel ``8i + j`` at bits ``3j``), stored little-endian in bytes ``3i .. 3i + 2``.
    """
    lo, _ = _CODE_RANGE[bits]
    u = (q.to(torch.int32) - lo).unflatten(-1, (-1, _GROUP[bits]))
    shifts = torch.arange(_GROUP[bits], device=q.device, dtype=torch.int32) * bits
    word = (u << shifts).sum(-1)  # the fields do not overlap: a sum is an or
    if bits == 2:
        return word.to(torch.uint8)
    return torch.stack([(word >> (8 * i)) & 255 for i in range(3)], dim=-1).flatten(-2).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[..., W]`` -> int8 codes ``[..., dim]``."""
    lo, _ = _CODE_RANGE[bits]
    group = _GROUP[bits]
    if bits == 2:
        word = packed.to(torch.int32)[..., None]
    else:
        b = packed.to(torch.int32).unflatten(-1, (-1, 3))
        word = (b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16))[..., None]
    shifts = torch.arange(group, device=packed.device, dtype=torch.int32) * bits
    fields = (word >> shifts) & ((1 << bits) - 1)
    return (fields.flatten(-2)[..., :dim] + lo).to(torch.int8)


def quantize_bits(
    x: torch.Tensor, bits: int, dim: int, zero_at: torch.Tensor | None = None, fit: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric ``bits``-bit codes of ``x [..., R, D]`` with an fp16 scale and zero point per
    slice along ``dim`` (``-2``: per channel; ``-1``: per row): ``(codes, scale, zero)``.

    ``fit="minmax"``: 4 and 8 bits are :func:`flashcodec.codecs.kivi.quantize_zero` (the kivi
    codecs' codes, bit for bit); 2 and 3 bits apply its rule (the zero point rounded to fp16 first,
    the scale then rounded up to reach both ends of the slice from it, so ``codes * scale + zero``
    is within ``scale / 2`` of ``x``) to their code ranges and pack the codes (:func:`pack_codes`).
    ``fit="gauss"`` (2 to 4 bits): the scale is :data:`_GAUSS_STEP` standard deviations of the
    slice and the levels sit symmetrically about its mean (zero point ``mean + scale / 2``), or about
    ``zero_at`` when given; elements beyond the outer levels are clipped to them.
    """
    if fit == "minmax" and bits in (4, 8):
        return quantize_zero(x, bits, dim, zero_at=zero_at)
    lo_code, hi_code = _CODE_RANGE[bits]
    xf = x.to(torch.float32)
    if fit == "gauss" and bits != 8:
        std, mean = torch.std_mean(xf, dim=dim, keepdim=True, correction=0)
        scale = (_GAUSS_STEP[bits] * std).clamp(0.0, _FP16_MAX / 2).to(torch.float16)
        middle = mean + scale.float() / 2 if zero_at is None else zero_at.to(torch.float32)
        zero = middle.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).float()
    else:
        lo, hi = torch.aminmax(xf, dim=dim, keepdim=True)
        steps = float(hi_code - lo_code)
        middle = lo - lo_code * (hi - lo) / steps if zero_at is None else zero_at.to(torch.float32)
        zero = middle.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).float()
        need = torch.maximum((zero - lo) / -lo_code, (hi - zero) / hi_code).clamp(0.0, _FP16_MAX / 2)
        scale = (need * (1.0 + 2.0**-10)).to(torch.float16)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = torch.round((xf - zero) / safe).clamp_(lo_code, hi_code)
    codes = pack_codes(q, bits) if bits < 4 else _pack_int4(q) if bits == 4 else q.to(torch.int8)
    return codes, scale, zero.to(torch.float16)


def _scale_of(code: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """fp32 ``base * 2**(-code / SCALE_LOG_STEPS)``: what an 8-bit scale code stands for (encode
    and decode both call this, so the codes are chosen against the scales read back)."""
    return base.float() * torch.exp2(code.float() * (-1.0 / SCALE_LOG_STEPS))


def _log_scale(need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``need`` fp32 ``[..., n, a, b]`` (scales >= 0) -> ``(uint8 codes, fp16 base [..., n, 1, 1])``
    whose scales (:func:`_scale_of`) are at least ``need`` where ``need`` is within 16 octaves of
    the block's largest (below that: the smallest code's scale, larger still)."""
    need = need.clamp(0.0, _FP16_MAX / 2)
    top = need.amax(dim=(-2, -1), keepdim=True)
    base = top.to(torch.float16)
    # rounded up to fp16, so that code 0 reaches the largest scale
    base = torch.where(base.float() < top, torch.nextafter(base, torch.full_like(base, _FP16_MAX)), base)
    ratio = torch.where(base.float() > 0, need / base.float().clamp_min(_TINY), torch.zeros_like(need))
    code = torch.floor(-SCALE_LOG_STEPS * torch.log2(ratio)).clamp(0, 255)
    # log2 / exp2 round: step a code back wherever its scale came out below the need
    code = torch.where((_scale_of(code, base) < need) & (code > 0), code - 1, code)
    return code.to(torch.uint8), base


def side8_values(
    scale: torch.Tensor, zero: torch.Tensor, base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(scales, zero points)`` of 8-bit side information as stored: uint8 scale codes, the
    zero points int8 half steps (or fp16 as they are) and the fp16 ``base`` of each block."""
    s = _scale_of(scale, base)
    if zero.dtype == torch.uint8:  # nibbles: row 2i in the low one, row 2i + 1 in the high one
        zero = torch.stack([zero & 15, zero >> 4], dim=-2).flatten(-3, -2).to(torch.int8) - 8
    z = zero.float() * (s * 0.5) if zero.dtype == torch.int8 else zero.float()
    return s, z


def quantize_side8(
    x: torch.Tensor, bits: int, dim: int, zero_bits: int = 8, zero_at: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_bits` (min-max) with 8-bit side information: ``x [..., n, R, D]`` ->
    ``(codes, uint8 scale codes, zero points, fp16 scale_base [..., n, 1, 1])``.

    The scales (:func:`side8_values`) are rounded up from the min-max step, so every element is
    within half a step of its level; ``zero_bits=8``: int8 zero points in half steps, the step
    first widened to ``|lo + hi| / 126`` where a slice's middle is that far from 0;
    ``zero_bits=4`` (per row, ``R`` even): the zero points in -7..7 half steps (the step widened to
    ``|lo + hi| / 6``), stored as nibbles ``z + 8``, two rows a byte (``[..., n, R / 2, 1]`` uint8);
    ``zero_bits=16``: fp16 zero points, ``zero_at`` (rounded to fp16) or the slice's middle, the
    scale reaching both ends from it (as :func:`quantize_bits`)."""
    lo_code, hi_code = _CODE_RANGE[bits]
    xf = x.to(torch.float32)
    lo, hi = torch.aminmax(xf, dim=dim, keepdim=True)
    if zero_bits == 16:
        middle = lo - lo_code * (hi - lo) / (hi_code - lo_code) if zero_at is None else zero_at.float()
        zero16 = middle.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        z = zero16.float()
        code, base = _log_scale(torch.maximum((z - lo) / -lo_code, (hi - z) / hi_code))
        zero = zero16
        s = _scale_of(code, base)
    else:
        # |lo + hi| / (top - 1) keeps the middle within top half steps of 0 (it lies half a step off centre)
        top = _ZERO_MAX[zero_bits]
        need = torch.maximum((hi - lo) / (hi_code - lo_code), (lo + hi).abs() / (top - 1))
        code, base = _log_scale(need)
        s = _scale_of(code, base)
        # the middle of the levels for this step; rounded to half steps it moves by s / 4 at most
        middle = (lo + hi) / 2 - (hi_code + lo_code) * s / 2
        half = torch.where(s > 0, s * 0.5, torch.ones_like(s))
        zero = torch.round(middle / half).clamp(-top, top).to(torch.int8)
        z = zero.float() * (s * 0.5)
        if zero_bits == 4:
            nib = (zero + 8).to(torch.uint8).unflatten(-2, (-1, 2))
            zero = nib[..., 0, :] | (nib[..., 1, :] << 4)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((xf - z) / safe).clamp_(lo_code, hi_code)
    codes = pack_codes(q, bits) if bits < 4 else _pack_int4(q) if bits == 4 else q.to(torch.int8)
    return codes, code, zero, base


def dequantize_bits(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dim: int
) -> torch.Tensor:
    """``codes * scale + zero`` in fp32 ``[..., R, dim]`` for codes of ``bits`` bits as stored."""
    if bits in (4, 8):
        return dequantize_zero(codes, scale, zero, dim)
    return unpack_codes(codes, bits, dim).to(torch.float32) * scale.float() + zero.float()


def _dim_of(codes: torch.Tensor, bits: int) -> int:
    """``D`` from the stored code width ``W``."""
    width = codes.shape[-1]
    return {2: 4 * width, 3: 8 * width // 3, 4: 2 * width, 8: width}[bits]


def _dequantized(parts: tuple[torch.Tensor, ...], bits: int, dtype: torch.dtype) -> torch.Tensor:
    codes, scale, zero = parts[:3]
    if len(parts) == 4:  # 8-bit side information
        s, z = side8_values(scale, zero, parts[3])
        q = unpack_codes(codes, bits, _dim_of(codes, bits)) if bits < 4 else _kernel_int(codes, bits)
        return (q.to(torch.float32) * s + z).to(dtype)
    return dequantize_bits(codes, scale, zero, bits, _dim_of(codes, bits)).to(dtype)


def _kernel_int(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """4- and 8-bit codes as integers ``[..., D]`` (int4 unpacked)."""
    return unpack_int4(codes, _dim_of(codes, bits)) if bits == 4 else codes


def _kernel_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes as the kernels read them: packed int4 and int8 as stored, 2 and 3 bits widened to int8."""
    return codes if bits in (4, 8) else unpack_codes(codes, bits, _dim_of(codes, bits))


def _code_spec(bits: int, rows: int, dim: int) -> PartSpec:
    return PartSpec("codes", (rows, code_width(bits, dim)), torch.int8 if bits == 8 else torch.uint8)


def _side8_specs(codes: PartSpec, side: tuple[int, int], zero_bits: int) -> tuple[PartSpec, ...]:
    """``(codes, scales uint8, zeros, scale_base [1, 1] fp16)``, ``side`` the shape of a scale
    (``(1, D)`` per channel, ``(R, 1)`` per row); zeros int8 (``zero_bits=8``), fp16 (16) or two
    nibbles a byte (4: ``(R / 2, 1)`` uint8)."""
    if zero_bits == 4:
        zeros = PartSpec("zeros", (side[0] // 2, 1), torch.uint8)
    else:
        zeros = PartSpec("zeros", side, torch.int8 if zero_bits == 8 else torch.float16)
    return (
        codes,
        PartSpec("scales", side, torch.uint8),
        zeros,
        PartSpec("scale_base", (1, 1), torch.float16),
    )


def _check_side(side_bits: object, range_fit: str) -> int:
    if (
        isinstance(side_bits, bool)
        or not isinstance(side_bits, numbers.Integral)
        or side_bits not in SIDE_BITS
    ):
        raise KVConfigError(
            f"side_bits must be one of {SIDE_BITS} (how scales and zero points are stored); got {side_bits!r}"
        )
    if side_bits == 8 and range_fit != "minmax":
        raise KVConfigError(f"side_bits=8 fits its levels min-max only; got range_fit={range_fit!r}")
    return int(side_bits)


def _check_zero_bits(name: str, zero_bits: object, side_bits: int, block_size: int) -> int:
    if isinstance(zero_bits, bool) or not isinstance(zero_bits, numbers.Integral) or zero_bits not in (8, 4):
        raise KVConfigError(f"{name} must be 8 or 4 (bits of a per-token zero point); got {zero_bits!r}")
    if zero_bits == 4 and (side_bits != 8 or block_size % 2):
        raise KVConfigError(
            f"{name}=4 packs two tokens' zero points a byte: it needs side_bits=8 and an even block_size; "
            f"got side_bits={side_bits}, block_size={block_size}"
        )
    return int(zero_bits)


class _Side8:
    """What a codec with ``side_bits`` shares: the fp32 scales and zero points, and the check of
    the 8-bit parts."""

    side_bits: int

    def _side(self, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.side_bits == 8:
            return side8_values(parts[1], parts[2], parts[3])
        return parts[1].float(), parts[2].float()

    def _side_scales(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return _scale_of(parts[1], parts[3]) if self.side_bits == 8 else parts[1].float()

    def check_part(self, spec: PartSpec, part: torch.Tensor, *, check_finite: bool) -> None:
        if spec.name == "scale_base" and not bool(torch.isfinite(part).all() and (part >= 0).all()):
            raise KVDataError(
                f"part 'scale_base' holds a negative or non-finite value; got {part.flatten()[:4]}"
            )
        super().check_part(spec, part, check_finite=check_finite)  # type: ignore[misc]


class _Rotated:
    """What both sides share: the rotation of the channels and its inverse."""

    mode: ClassVar[str]
    seed: int

    def _rotates(self) -> bool:
        raise NotImplementedError

    def channel_rotation(self, dim: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """``M`` fp32 ``[dim, dim]`` (:func:`hadamard_rotation`) when this side rotates, else None:
        the stored rows are ``x @ M`` of the tokens ``x``. One tensor per ``(dim, seed, device)``,
        shared by every call: read it, never write into it (:func:`hadamard_rotation` gives a copy)."""
        if not self._rotates():
            return None
        return _rotation_on(int(dim), self.seed, torch.device("cpu" if device is None else device))

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``x @ M`` (or ``x`` in fp32 when this side does not rotate)."""
        m = self.channel_rotation(x.shape[-1], x.device)
        xf = x.to(torch.float32)
        return xf if m is None else xf @ m

    def _unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """fp32 ``y @ M^T``."""
        m = self.channel_rotation(y.shape[-1], y.device)
        return y if m is None else y @ m.T


def _check_fit(fit: object) -> str:
    if not isinstance(fit, str) or fit not in RANGE_FITS:
        raise KVConfigError(f"range_fit must be one of {RANGE_FITS}; got {fit!r}")
    return fit


def _check_sink(name: str, tokens: object, block_size: int) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or not 0 <= tokens <= block_size:
        raise KVConfigError(
            f"{name} must be an integer from 0 to block_size={block_size} (the first tokens kept apart); "
            f"got {tokens!r}"
        )
    return int(tokens)


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise KVConfigError(f"seed must be an integer >= 0 (the rotation's random signs); got {seed!r}")
    return int(seed)


@dataclass(frozen=True)
class RotatedTokenIntCodec(_Side8, _Rotated, TokenRows, RowAffine):
    """Values: each token rotated (``x @ M``), then ``bits``-bit asymmetric codes with an fp16 scale
    and zero point per token; :class:`RotatedKIVICodec`'s value codec.

    Args:
        block_size: ``r`` (>= 1); tokens are coded independently, the block is the archive's unit.
        bits: 2, 3, 4 or 8.
        raw_window, window_bits: the tail, as :class:`~flashcodec.codecs.KIVICodec` (kept unrotated).
        rotate: whether to rotate (False: plain per-token codes, e.g. to test 2- and 3-bit codes alone).
        seed: the rotation's random signs.
        range_fit: ``"minmax"`` (default) or ``"gauss"``: how each token's levels are fitted
            (:func:`quantize_bits`; 8-bit codes are always min-max).
        side_bits: 16 (fp16 scale and zero point per token) or 8 (an 8-bit scale code and an
            int8 zero point per token, one fp16 ``scale_base`` per block; min-max only).
        zero_bits: with ``side_bits=8``, each token's zero point in 8 bits (default) or 4 (-7..7
            half steps, two tokens a byte; a token whose middle is further from 0 gets a coarser step).
        sink_tokens: the sequence's first tokens (0 to ``block_size``; default 0) a stream keeps
            apart in the tail's form (int8 per token with ``window_bits=8``), unrotated, once block
            0 is archived: a value sink (:attr:`~flashcodec.codecs.BlockCodec.sink_tokens`).
    """

    mode: ClassVar[str] = "token-int-rot"

    block_size: int = 64
    bits: int = 4
    raw_window: int = 0
    window_bits: int | None = None
    rotate: bool = True
    seed: int = 0
    range_fit: str = "minmax"
    side_bits: int = 16
    zero_bits: int = 8
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", check_block_size(self.block_size))
        object.__setattr__(self, "bits", _check_bits("bits", self.bits))
        object.__setattr__(self, "sink_tokens", _check_sink("sink_tokens", self.sink_tokens, self.block_size))
        set_window_fields(self)
        object.__setattr__(self, "rotate", _check_flag("rotate", self.rotate))
        object.__setattr__(self, "seed", _check_seed(self.seed))
        object.__setattr__(self, "range_fit", _check_fit(self.range_fit))
        object.__setattr__(self, "side_bits", _check_side(self.side_bits, self.range_fit))
        object.__setattr__(
            self, "zero_bits", _check_zero_bits("zero_bits", self.zero_bits, self.side_bits, self.block_size)
        )

    def _rotates(self) -> bool:
        return self.rotate

    @property
    def int4_zero_nibble(self) -> bool:  # type: ignore[override]
        # packed codes of 2 to 4 bits, and 8-bit scale codes, use every byte value
        return self.bits != 8 or self.side_bits == 8

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        codes = _code_spec(self.bits, self.block_size, dim)
        if self.side_bits == 8:
            return _side8_specs(codes, (self.block_size, 1), self.zero_bits)
        return row_affine_specs(codes, self.block_size)

    def check_dim(self, dim: int) -> None:
        _check_packable(self.mode, "bits", self.bits, dim)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., n*r, D]`` -> ``(codes, fp16 scales, fp16 zeros [..., n, r, 1])`` of ``x @ M``
        (``side_bits=8``: uint8 scale codes, int8 zeros and the fp16 ``scale_base [..., n, 1, 1]``)."""
        rows = self._rotate(to_blocks(x, self.block_size))
        if self.side_bits == 8:
            return quantize_side8(rows, self.bits, -1, self.zero_bits)
        return quantize_bits(rows, self.bits, -1, fit=self.range_fit)

    def _dequantize(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """The rotated tokens ``x @ M`` as stored: ``[..., n, r, D]`` in ``dtype``."""
        return _dequantized(parts, self.bits, dtype)

    def _kernel_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return _kernel_codes(codes, self.bits)


@dataclass(frozen=True)
class RotatedKIVICodec(_Side8, _Rotated, TokenRows, ChannelAffine):
    """Keys rotated then coded per (block, channel), values rotated then coded per token.

    This object codes the keys; :attr:`value_codec` is the :class:`RotatedTokenIntCodec` of the
    values (the same ``block_size``, ``raw_window``, ``window_bits`` and ``seed``).

    Args:
        block_size: ``r``, tokens per block (64 by default).
        key_bits, value_bits: 2, 3, 4 or 8 (``D`` a multiple of 4 for 2 bits, of 8 for 3 bits, even
            for 4 bits).
        raw_window: newest tokens kept out of the blocks (default 64), unrotated.
        window_bits: the tail in the input dtype (None) or int8 per token (8, the default).
        exact_sink: the first key of the sequence, rotated, is block 0's zero points (stored as code
            0): it comes back as its fp16 rounding rotated back, in fp32 arithmetic (see
            :class:`~flashcodec.codecs.KIVICodec`).
        rotate_keys, rotate_values: which side is rotated (both by default): by a signed Hadamard
            matrix where ``D`` is a power of two, else by a seeded random orthogonal matrix.
        seed: the random signs of the rotation (one rotation for every head and layer).
        range_fit: ``"minmax"`` (default: every element within half a step) or ``"gauss"`` (the
            step of the best uniform quantizer of a Gaussian, tails clipped; 2 to 4 bits), for
            both sides (:func:`quantize_bits`).
        side_bits: 16 (fp16 scales and zero points, the default) or 8 (8-bit scale codes against
            one fp16 ``scale_base`` per block, int8 zero points in half steps: a quarter bit an
            element a side at ``r = D = 64`` instead of half a bit), for both sides; the keys'
            zero points stay fp16 under ``exact_sink`` (min-max only).
        value_zero_bits: with ``side_bits=8``, the values' per-token zero points in 8 bits
            (default) or 4 (:class:`RotatedTokenIntCodec`'s ``zero_bits``).
        value_sink_tokens: the values of the sequence's first tokens (0 to ``block_size``; default
            0) kept apart in the tail's form (int8 per token with ``window_bits=8``) once block 0 is
            archived, instead of in block 0's codes (:class:`RotatedTokenIntCodec`'s
            ``sink_tokens``): with ``exact_sink``, the attention sink's key is exact and its value
            at the window's precision.
    """

    mode: ClassVar[str] = "kivi-rot"

    block_size: int = 64
    key_bits: int = 4
    value_bits: int = 4
    raw_window: int = 64
    window_bits: int | None = 8
    exact_sink: bool = True
    rotate_keys: bool = True
    rotate_values: bool = True
    seed: int = 0
    range_fit: str = "minmax"
    side_bits: int = 16
    value_zero_bits: int = 8
    value_sink_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", check_block_size(self.block_size))
        object.__setattr__(self, "exact_sink", _check_flag("exact_sink", self.exact_sink))
        object.__setattr__(self, "key_bits", _check_bits("key_bits", self.key_bits))
        object.__setattr__(self, "value_bits", _check_bits("value_bits", self.value_bits))
        set_window_fields(self)
        object.__setattr__(self, "rotate_keys", _check_flag("rotate_keys", self.rotate_keys))
        object.__setattr__(self, "rotate_values", _check_flag("rotate_values", self.rotate_values))
        object.__setattr__(self, "seed", _check_seed(self.seed))
        object.__setattr__(self, "range_fit", _check_fit(self.range_fit))
        object.__setattr__(self, "side_bits", _check_side(self.side_bits, self.range_fit))
        zero_bits = _check_zero_bits("value_zero_bits", self.value_zero_bits, self.side_bits, self.block_size)
        object.__setattr__(self, "value_zero_bits", zero_bits)
        sink = _check_sink("value_sink_tokens", self.value_sink_tokens, self.block_size)
        object.__setattr__(self, "value_sink_tokens", sink)

    def _rotates(self) -> bool:
        return self.rotate_keys

    @property
    def _key_zero_bits(self) -> int:
        # the exact sink is block 0's zero points: those must hold an fp16 key
        return 16 if self.exact_sink or self.side_bits == 16 else 8

    @property
    def value_codec(self) -> RotatedTokenIntCodec:  # type: ignore[override]
        """The values' codec: rotated per-token ``value_bits`` codes over the same blocks and tail."""
        return RotatedTokenIntCodec(
            self.block_size,
            self.value_bits,
            self.raw_window,
            self.window_bits,
            self.rotate_values,
            self.seed,
            self.range_fit,
            self.side_bits,
            self.value_zero_bits,
            self.value_sink_tokens,
        )

    @property
    def int4_zero_nibble(self) -> bool:  # type: ignore[override]
        return self.key_bits != 8 or self.side_bits == 8

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        codes = _code_spec(self.key_bits, self.block_size, dim)
        if self.side_bits == 8:
            return _side8_specs(codes, (1, dim), self._key_zero_bits)
        return channel_affine_specs(codes, dim)

    def check_dim(self, dim: int) -> None:
        """``KVShapeError`` when keys or values of head dimension ``dim`` cannot be stored."""
        _check_packable(self.mode, "key_bits", self.key_bits, dim)
        self.value_codec.check_dim(dim)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Keys ``x [..., n*r, D]`` -> ``(codes, fp16 scales, fp16 zeros [..., n, 1, D])`` of ``x @ M``;
        every block as a later block of a stream (no sink: see :meth:`encode_blocks`); with
        ``side_bits=8`` as :func:`quantize_side8` gives them."""
        rows = self._rotate(to_blocks(x, self.block_size))
        if self.side_bits == 8:
            return quantize_side8(rows, self.key_bits, -2, self._key_zero_bits)
        return quantize_bits(rows, self.key_bits, -2, fit=self.range_fit)

    def encode_blocks(self, x: torch.Tensor, first_block: int) -> tuple[torch.Tensor, ...]:
        """:meth:`encode`, except that with :attr:`exact_sink` block 0 (``first_block == 0``) takes
        its first (rotated) token as the zero point of every channel."""
        return encode_with_sink(self, x, first_block, self._encode_sink_block)

    def _encode_sink_block(self, block: torch.Tensor) -> tuple[torch.Tensor, ...]:
        head = self._rotate(block)
        if self.side_bits == 8:
            return quantize_side8(head, self.key_bits, -2, 16, zero_at=head[..., :1, :])
        return quantize_bits(head, self.key_bits, -2, zero_at=head[..., :1, :], fit=self.range_fit)

    def _dequantize(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """The rotated key tokens ``x @ M`` as stored: ``[..., n, r, D]`` in ``dtype``."""
        return _dequantized(parts, self.key_bits, dtype)

    def _kernel_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return _kernel_codes(codes, self.key_bits)
