"""Lossless bf16 / fp16 K/V that shrinks: 4-bit exponents against a per-(group, channel) maximum.

A 16-bit float is a sign, an exponent field (bf16: 8 bits, fp16: 5) and a mantissa (7, 10). In
real K/V the sign and mantissa bits are close to uniformly random, but the exponents of one
channel over a few dozen tokens span a narrow range (DFloat11 codes bf16 *weights* to ~70% on the
same observation). :class:`ExponentCoder` stores, bit for bit:

* the sign and mantissa bits as they are (bf16: one byte an element; fp16: 11 bits, as one byte
  plus three bits beside the exponent code);
* per group of ``group`` tokens and channel, the largest exponent (one byte), and per element a
  4-bit code ``max - exponent`` (0..14); code 15 means a zero / subnormal (exponent field 0) or,
  when the element is listed among the exceptions, an exponent more than 14 below the maximum
  (listed by flat index, int32 or int64, with its exponent: rare on real K/V).

Decoding is a few elementwise torch ops and one scatter (memory-bound, no entropy decoder), so
the packed form can stay in memory; :meth:`ExponentPacked.to_bytes` adds a zlib pass over the
exponent codes for a saved file (the codes have about 2.5 bits of entropy, the nibble spends 4).

Why not a :class:`~flashcodec.codecs.BlockCodec` (a tier): a stream's archive and the attention
kernels address every block at a fixed size, and no fixed-size code of arbitrary 16-bit values is
both lossless and smaller than 16 bits an element (there are ``2**16`` values to tell apart).
Shrinking losslessly needs the variable part (here the exceptions, in the saved form also the
entropy code), so this coder is for archived (cold) K/V held aside, offloaded or saved, not for
the blocks attention reads in place. ``docs/flashcodec.md`` has its measured sizes and speeds.
"""

from __future__ import annotations

import io
import json
import numbers
import zlib
from dataclasses import dataclass

import torch
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError

__all__ = ["ExponentCoder", "ExponentPacked", "FORMATS"]

#: dtype -> (exponent bits, mantissa bits)
FORMATS: dict[torch.dtype, tuple[int, int]] = {torch.bfloat16: (8, 7), torch.float16: (5, 10)}
#: the code of an exponent field of 0, and of an exception
ESCAPE = 15
_MAGIC = b"FCLL1"


def _check_group(group: object) -> int:
    if isinstance(group, bool) or not isinstance(group, numbers.Integral) or group < 2 or group % 2:
        raise KVConfigError(f"group must be an even integer >= 2 (tokens per exponent group); got {group!r}")
    return int(group)


@dataclass(frozen=True)
class ExponentPacked:
    """One tensor in the coded form of :class:`ExponentCoder` (every field measured by ``nbytes``).

    Attributes:
        shape: the original ``[..., S, D]`` shape; ``dtype``: bf16 or fp16; ``group``: tokens per group.
        rest: uint8, one byte an element (channel-major): bf16 sign and mantissa; fp16 the
            mantissa's low byte.
        codes: uint8 exponent codes, two a byte (bf16); fp16: one a byte, the sign and the
            mantissa's top two bits in its upper nibble.
        top: uint8 ``[..., D, n_groups]``: the largest exponent of each (channel, group).
        exc_index, exc_exponent: flat indices (into the channel-major, group-padded layout) and
            exponents of the elements more than 14 below their group's largest exponent.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    group: int
    rest: torch.Tensor
    codes: torch.Tensor
    top: torch.Tensor
    exc_index: torch.Tensor
    exc_exponent: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held (what keeping this form in memory costs)."""
        return sum(t.nbytes for t in (self.rest, self.codes, self.top, self.exc_index, self.exc_exponent))

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the original tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return 2 * n

    @property
    def exceptions(self) -> int:
        return int(self.exc_index.numel())

    def to_bytes(self, level: int = 6) -> bytes:
        """A self-describing byte string for a file: the exponent codes, maxima and exceptions
        zlib-compressed at ``level`` (0-9), the sign / mantissa bytes as they are."""
        if isinstance(level, bool) or not isinstance(level, numbers.Integral) or not 0 <= level <= 9:
            raise KVConfigError(f"level must be an integer 0..9 (zlib); got {level!r}")
        codes = self.codes.cpu()
        if self.dtype == torch.bfloat16:  # one code a byte: zlib's Huffman stage codes bytes
            codes = torch.stack([codes & 15, codes >> 4], dim=-1).flatten()
        side = [codes, self.top.cpu(), self.exc_index.cpu(), self.exc_exponent.cpu()]
        packed = zlib.compress(b"".join(t.contiguous().numpy().tobytes() for t in side), level)
        header = json.dumps(
            {
                "shape": list(self.shape),
                "dtype": str(self.dtype).removeprefix("torch."),
                "group": self.group,
                "sizes": [t.numel() for t in side],
                "index_dtype": str(self.exc_index.dtype).removeprefix("torch."),
                "rest": self.rest.numel(),
            }
        ).encode()
        out = io.BytesIO()
        for chunk in (
            _MAGIC,
            len(header).to_bytes(4, "little"),
            header,
            self.rest.cpu().numpy().tobytes(),
            packed,
        ):
            out.write(chunk)
        return out.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> ExponentPacked:
        """The inverse of :meth:`to_bytes` (CPU tensors); ``KVDataError`` on bytes it did not write."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise KVDtypeError(f"data must be bytes; got {type(data).__name__}")
        data = bytes(data)
        if not data.startswith(_MAGIC):
            raise KVDataError("data is not an ExponentPacked byte string (bad magic)")
        try:
            n = int.from_bytes(data[5:9], "little")
            meta = json.loads(data[9 : 9 + n])
            at = 9 + n
            rest = torch.frombuffer(bytearray(data[at : at + meta["rest"]]), dtype=torch.uint8)
            side = zlib.decompress(data[at + meta["rest"] :])
            dtype = getattr(torch, meta["dtype"])
            index_dtype = getattr(torch, meta["index_dtype"])
            tensors, off = [], 0
            for size, dt in zip(
                meta["sizes"], (torch.uint8, torch.uint8, index_dtype, torch.uint8), strict=True
            ):
                width = torch.empty((), dtype=dt).element_size()
                tensors.append(
                    torch.frombuffer(bytearray(side[off : off + size * width]), dtype=dt)
                    if size
                    else torch.empty(0, dtype=dt)
                )
                off += size * width
            codes, top, exc_index, exc_exponent = tensors
            if dtype == torch.bfloat16:
                codes = codes.view(-1, 2)
                codes = codes[:, 0] | (codes[:, 1] << 4)
            shape = tuple(int(n) for n in meta["shape"])
            top = top.view(*shape[:-2], shape[-1], -1)
            return cls(shape, dtype, int(meta["group"]), rest, codes, top, exc_index, exc_exponent)
        except (ValueError, KeyError, IndexError, zlib.error, AttributeError, TypeError, RuntimeError) as err:
            raise KVDataError(f"data is a damaged ExponentPacked byte string: {err}") from None


@dataclass(frozen=True)
class ExponentCoder:
    """Bit-exact coder of bf16 / fp16 ``[..., S, D]`` tensors (see the module docstring).

    Args:
        group: tokens per exponent group (an even integer >= 2; default 64). Larger groups spend
            less on the per-group maxima but see wider exponent ranges (more exceptions).
    """

    group: int = 64

    def __post_init__(self) -> None:
        _check_group(self.group)

    def encode(self, x: torch.Tensor) -> ExponentPacked:
        """``x [..., S, D]`` bf16 or fp16 (S, D >= 1) -> :class:`ExponentPacked` on ``x``'s device."""
        if not isinstance(x, torch.Tensor):
            raise KVDtypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
        if x.dtype not in FORMATS:
            raise KVDtypeError(f"x must be bfloat16 or float16 (a lossless 16-bit code); got {x.dtype}")
        if x.dim() < 2 or x.shape[-1] < 1 or x.shape[-2] < 1:
            raise KVShapeError(f"x must be [..., S, D] with S, D >= 1; got shape {tuple(x.shape)}")
        e_bits, m_bits = FORMATS[x.dtype]
        g = self.group
        s, d = x.shape[-2], x.shape[-1]
        n_groups = -(-s // g)
        # channel-major, padded to whole groups: [..., D, n_groups, g] (padding: +0.0, code 15)
        plain = x.transpose(-1, -2).contiguous().view(torch.int16)  # [..., D, S]
        bits = torch.nn.functional.pad(plain, (0, n_groups * g - s)).view(*x.shape[:-2], d, n_groups, g)
        # int16 shifts are arithmetic: mask after shifting so the sign bit never leaks in
        exponent = ((bits >> m_bits) & ((1 << e_bits) - 1)).to(torch.uint8)
        top = exponent.amax(dim=-1, keepdim=True)
        offset = top - exponent  # >= 0: no wrap
        exc = (offset >= ESCAPE) & (exponent != 0)
        code = offset.masked_fill((offset >= ESCAPE) | (exponent == 0), ESCAPE)
        flat_exc = exc.flatten()
        index_dtype = torch.int32 if flat_exc.numel() < 2**31 else torch.int64
        exc_index = flat_exc.nonzero().flatten().to(index_dtype)
        exc_exponent = exponent.flatten()[exc_index.long()]
        if m_bits == 7:  # bf16: sign + mantissa in one byte, codes two a byte
            # the padding's bytes are not kept: only the codes need whole groups
            rest = (((plain >> 8) & 0x80) | (plain & 0x7F)).to(torch.uint8).flatten()
            flat = code.flatten()
            codes = flat[0::2] | (flat[1::2] << 4)  # g is even, so the count is even
        else:  # fp16: the mantissa's low byte apart; sign and its top 2 bits above the code
            rest = (plain & 0xFF).to(torch.uint8).flatten()
            high = (((bits >> 13) & 4) | ((bits >> 8) & 3)).to(torch.uint8)
            codes = (code | (high << 4)).flatten()
        return ExponentPacked(
            tuple(x.shape),
            x.dtype,
            g,
            rest,
            codes,
            top.squeeze(-1).to(torch.uint8),
            exc_index,
            exc_exponent,
        )

    @staticmethod
    def decode(packed: ExponentPacked) -> torch.Tensor:
        """The original tensor, bit for bit (on the packed tensors' device)."""
        if not isinstance(packed, ExponentPacked):
            raise KVDtypeError(f"packed must be an ExponentPacked; got {type(packed).__name__}")
        e_bits, m_bits = FORMATS[packed.dtype]
        *lead, s, d = packed.shape
        g = packed.group
        n_groups = packed.top.shape[-1]
        if m_bits == 7:
            code = torch.stack([packed.codes & 15, packed.codes >> 4], dim=-1)
        else:
            code = packed.codes & 15
        code = code.view(*lead, d, n_groups, g)
        # uint8 arithmetic: a code-15 slot may wrap below 0 here and is zeroed next
        exponent = (packed.top.unsqueeze(-1) - code).masked_fill_(code == ESCAPE, 0).flatten()
        if packed.exc_index.numel():
            exponent[packed.exc_index.long()] = packed.exc_exponent
        exponent = (exponent.to(torch.int16) << m_bits).view(*lead, d, n_groups * g)[..., :s]
        rest = packed.rest.to(torch.int16).view(*lead, d, s)
        if m_bits == 7:
            bits = exponent | ((rest & 0x80) << 8) | (rest & 0x7F)
        else:
            high = (packed.codes >> 4).to(torch.int16).view(*lead, d, n_groups * g)[..., :s]
            bits = exponent | ((high & 4) << 13) | ((high & 3) << 8) | rest
        return bits.view(packed.dtype).transpose(-1, -2).contiguous()
