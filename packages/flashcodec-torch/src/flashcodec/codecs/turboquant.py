"""TurboQuant's MSE quantizer (Zandieh et al., 2025), per token and head, keys and values alike.

"TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate" quantizes a vector ``x``
of ``D`` values without any data: it keeps the norm ``|x|``, turns the unit vector ``x / |x|`` by a
random rotation ``M`` (a seeded random orthogonal matrix here, the paper's choice, so every input
vector meets the same coordinate law), and quantizes each rotated coordinate on its own with a
Lloyd-Max scalar codebook. A coordinate of a uniformly random unit vector follows a Beta law that
is close to ``N(0, 1/D)`` at head sizes of 64 and up; the codebook is Lloyd-Max's for that
Gaussian (:func:`lloyd_max_codebook`, computed once per width in float64, stored in units of the
standard deviation ``1/sqrt(D)``). Its distortion for a unit vector is the paper's
``D_mse``: about 0.36, 0.117, 0.035 and 0.0095 at 1 to 4 bits a coordinate (:func:`lloyd_max_mse`).

This is the paper's MSE variant only: its inner-product variant spends one of the bits on a 1-bit
QJL sketch of the residual, which is not implemented here.

Stored parts per block of ``r`` tokens (``b`` bits: 2, 3 or 4), in the rotated basis:

* ``codes [r, W]`` uint8: the codebook index ``i`` of each coordinate as the signed code
  ``i - 2**(b-1)``, packed as :func:`flashcodec.codecs.rotated.pack_codes` packs 2- and 3-bit codes
  (``W = D/4``, ``3 D/8``) and as the package's int4 at 4 bits (``W = D/2``, nibble ``= i``);
* ``norms [r, 1]`` fp16: ``|x|`` per token (saturated at fp16's largest value).

So a token costs ``b D + 16`` bits: 34 bytes at ``D = 64`` and 4 bits (bf16: 128). The codec has
no structure along the sequence: a block is only the unit of the archive, so ``block_size`` can be
small; tokens of an incomplete block wait in the tail (raw by default).

Attention runs through the codec's row interface: the stored rows are ``|x| / sqrt(D) * c[i]`` in
the rotated basis, handed to the kernels as the codebook values ``c[i]`` (fp16, looked up from the
codes per call: a transient copy of two bytes a coordinate, since the kernels read only linear
int8 / int4 codes and a Lloyd-Max codebook is not linear) with the row scale ``|x| / sqrt(D)``, and
:meth:`TurboQuantCodec.channel_rotation` rotates the query and output. Decoding uses the same fp16
codebook values, so both paths reconstruct the same tokens. No Triton kernel reads these codes.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch
from kvspec import KVConfigError, KVDataError, KVShapeError

from .affine import TokenRows
from .base import PartSpec, check_block_size, check_finite_part, to_blocks, to_output
from .quant import _pack_int4, packed_width, unpack_int4
from .rotated import pack_codes, unpack_codes
from .tail import set_window_fields

__all__ = [
    "TURBOQUANT_BITS",
    "CODEBOOK_BITS",
    "TurboQuantCodec",
    "lloyd_max_codebook",
    "lloyd_max_mse",
    "random_rotation",
]

#: code widths the codec stores (packed: four 2-bit codes a byte, eight 3-bit codes in three bytes, two 4-bit)
TURBOQUANT_BITS = (2, 3, 4)
#: widths :func:`lloyd_max_codebook` computes (1 bit too, for the paper's distortion table)
CODEBOOK_BITS = (1, 2, 3, 4)
#: coordinates one packed group holds
_GROUP = {2: 4, 3: 8, 4: 2}
_FP16_MAX = float(torch.finfo(torch.float16).max)
_TINY = float(torch.finfo(torch.float32).tiny)


# --------------------------------------------------------------------------- the codebook
def _check_codebook_bits(bits: object, allowed: tuple[int, ...] = CODEBOOK_BITS, name: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or int(bits) not in allowed:
        raise KVConfigError(f"{name} must be one of {allowed}; got {bits!r}")
    return int(bits)


@lru_cache(maxsize=8)
def _lloyd_max(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Lloyd's alternation on the Gaussian's exact cell integrals: boundaries at the midpoints of
    # neighbouring centroids, centroids at the conditional means of their cells
    levels = 2**bits
    c = torch.special.ndtri((torch.arange(levels, dtype=torch.float64) + 0.5) / levels)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(100_000):
        edges = torch.cat([-inf, (c[1:] + c[:-1]) / 2, inf])
        pdf = torch.exp(-0.5 * edges**2) / math.sqrt(2 * math.pi)  # 0 at the infinite edges
        mass = torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1])
        new = (pdf[:-1] - pdf[1:]) / mass
        done = float((new - c).abs().max()) < 1e-14
        c = new
        if done:
            break
    # the law is symmetric: average the two halves so rounding leaves no drift between them
    c = (c - c.flip(0)) / 2
    return c, (c[1:] + c[:-1]) / 2


def lloyd_max_codebook(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``2**bits``-level Lloyd-Max quantizer of ``N(0, 1)``: ``(centroids, boundaries)``, float64.

    ``centroids [2**bits]`` ascending; ``boundaries [2**bits - 1]`` the inner cell edges, each the
    midpoint of its two centroids, and each centroid the mean of ``N(0, 1)`` over its cell. For a
    coordinate of ``N(0, 1/D)`` scale both by ``1/sqrt(D)``. ``bits``: 1 to 4. Copies: the cached
    ones cannot be changed through them.
    """
    c, t = _lloyd_max(_check_codebook_bits(bits))
    return c.clone(), t.clone()


def lloyd_max_mse(bits: int) -> float:
    """The distortion ``E[(X - c(X))^2]`` of :func:`lloyd_max_codebook` for ``X ~ N(0, 1)``: for a unit
    vector of ``D`` coordinates of variance ``1/D``, the expected squared error of the whole vector."""
    c, t = _lloyd_max(_check_codebook_bits(bits))
    inf = torch.tensor([math.inf], dtype=torch.float64)
    edges = torch.cat([-inf, t, inf])
    mass = torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1])
    # with every centroid its cell's mean, E[X c(X)] = E[c(X)^2]: the error is 1 - sum p c^2
    return float(1.0 - (mass * c**2).sum())


@lru_cache(maxsize=8)
def _codebook_fp16(bits: int) -> torch.Tensor:
    return lloyd_max_codebook(bits)[0].to(torch.float16)


@lru_cache(maxsize=32)
def _codebook_on(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # (fp16 centroids, fp32 boundaries) on one device: asked for at every step of every layer
    _, t = _lloyd_max(bits)
    return _codebook_fp16(bits).to(device), t.to(torch.float32).to(device)


# --------------------------------------------------------------------------- the rotation
@lru_cache(maxsize=32)
def _rotation(dim: int, seed: int) -> torch.Tensor:
    # Haar-distributed: the Q of a seeded Gaussian's QR with the signs of R's diagonal taken out
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(torch.float32)


@lru_cache(maxsize=32)
def _rotation_on(dim: int, seed: int, device: torch.device) -> torch.Tensor:
    return _rotation(dim, seed).to(device)


def random_rotation(dim: int, seed: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """TurboQuant's rotation ``M``: fp32 ``[dim, dim]``, a uniformly random orthogonal matrix drawn from
    ``seed`` (``M M^T = I``). A token ``x`` is stored as ``x @ M``. A copy on ``device``."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 1:
        raise KVShapeError(f"random_rotation: dim must be a positive integer; got {dim!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise KVConfigError(f"random_rotation: seed must be an integer >= 0; got {seed!r}")
    return _rotation(int(dim), int(seed)).to(device, copy=True)


# --------------------------------------------------------------------------- the codec
@dataclass(frozen=True)
class TurboQuantCodec(TokenRows):
    """TurboQuant (MSE variant): per token, an fp16 norm and ``bits``-bit Lloyd-Max codes of the
    randomly rotated unit vector (see the module docstring). Keys and values use the same codec.

    Args:
        block_size: ``r``, tokens per archived block (>= 1). Tokens are coded independently; until
            a block is complete its tokens stay in the tail.
        bits: 2, 3 or 4 bits a coordinate (``D`` a multiple of 4, 8 or 2 respectively).
        seed: the rotation's seed (an integer >= 0), the same for every layer and head.
        raw_window, window_bits: the tail, as :class:`~flashcodec.codecs.ChannelInt4Codec`
            (default: no raw window, the incomplete block in the input dtype).
    """

    mode: ClassVar[str] = "turboquant"
    # every byte is a valid group of codes (the nibble 0 is codebook index 0)
    int4_zero_nibble: ClassVar[bool] = True

    block_size: int = 8
    bits: int = 4
    seed: int = 0
    raw_window: int = 0
    window_bits: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", check_block_size(self.block_size))
        object.__setattr__(self, "bits", _check_codebook_bits(self.bits, TURBOQUANT_BITS))
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise KVConfigError(f"seed must be an integer >= 0 (the rotation's seed); got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        set_window_fields(self)

    # ---- layout
    def _width(self, dim: int) -> int:
        return packed_width(dim) if self.bits == 4 else dim * self.bits // 8

    def _dim_of(self, codes: torch.Tensor) -> int:
        width = codes.shape[-1]
        return {2: 4 * width, 3: 8 * width // 3, 4: 2 * width}[self.bits]

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        r = self.block_size
        return (
            PartSpec("codes", (r, self._width(dim)), torch.uint8),
            PartSpec("norms", (r, 1), torch.float16),
        )

    def check_dim(self, dim: int) -> None:
        group = _GROUP[self.bits]
        if dim % group:
            raise KVShapeError(
                f"{self.mode} packs {group} {self.bits}-bit codes together along D (bits={self.bits}): "
                f"D must be a multiple of {group}; got D={dim}"
            )

    def check_part(self, spec: PartSpec, part: torch.Tensor, *, check_finite: bool) -> None:
        """Codes: every byte is valid. Norms: finite and >= 0, always (they scale a whole token)."""
        check_finite_part(spec, part, check_finite=True)
        if spec.name == "norms" and bool((part < 0).any()):
            raise KVDataError("part 'norms' holds a negative norm (a vector's length is >= 0)")

    # ---- the rotation
    def channel_rotation(self, dim: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """``M`` fp32 ``[dim, dim]`` (:func:`random_rotation` of :attr:`seed`): the stored rows are the
        tokens ``x @ M``. Shared by every call: read it, never write into it."""
        return _rotation_on(int(dim), self.seed, torch.device("cpu" if device is None else device))

    def _unrotate(self, y: torch.Tensor) -> torch.Tensor:
        return y @ self.channel_rotation(y.shape[-1], y.device).T

    # ---- coding
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., n*r, D]`` -> ``(codes uint8 [..., n, r, W], norms fp16 [..., n, r, 1])``."""
        blocks = to_blocks(x, self.block_size)
        dim = blocks.shape[-1]
        self.check_dim(dim)
        xf = blocks.to(torch.float32)
        norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        # the unit vector in units of its coordinates' standard deviation 1/sqrt(D); a zero token
        # stays zero (its norm is 0, whatever its codes)
        unit = xf * (math.sqrt(dim) / norm.clamp_min(_TINY))
        _, bounds = _codebook_on(self.bits, xf.device)
        index = torch.bucketize(unit @ self.channel_rotation(dim, xf.device), bounds)
        q = index - 2 ** (self.bits - 1)
        codes = _pack_int4(q) if self.bits == 4 else pack_codes(q, self.bits)
        return codes, norm.clamp(max=_FP16_MAX).to(torch.float16)

    def _centroids(self, codes: torch.Tensor) -> torch.Tensor:
        """fp16 ``[..., D]``: the codebook value (in standard deviations) of every stored code."""
        dim = self._dim_of(codes)
        q = unpack_int4(codes, dim) if self.bits == 4 else unpack_codes(codes, self.bits, dim)
        table, _ = _codebook_on(self.bits, codes.device)
        return table[q.long() + 2 ** (self.bits - 1)]

    def _row_scales(self, norms: torch.Tensor, dim: int) -> torch.Tensor:
        """fp32 ``[..., n, r, 1]``: each token's norm over ``sqrt(D)``."""
        return norms.float() * (1.0 / math.sqrt(dim))

    def stored_rows(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """The rotated tokens ``[..., n, r, D]`` in ``dtype``: ``|x| / sqrt(D) * c[i]``."""
        self.check_parts(parts)
        codes, norms = parts
        values = self._centroids(codes)
        return to_output(values.float() * self._row_scales(norms, values.shape[-1]), dtype)

    def row_segments(
        self, parts: tuple[torch.Tensor, ...]
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """``((fp16 codebook values [..., n, r, D],), fp32 row scales [..., n, r])``: the values are
        looked up from the codes for this call (a transient copy, see the module docstring)."""
        self.check_parts(parts)
        codes, norms = parts
        values = self._centroids(codes)
        return (values,), self._row_scales(norms, values.shape[-1])[..., 0]
