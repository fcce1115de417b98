"""Lossless bf16 / fp16 K/V past order-0: adaptive context models and a range coder.

:class:`~flashcodec.codecs.lossless.ExponentCoder` spends about 11 of 16 bits on real bf16 K/V:
its exponent codes are close to order-0 entropy and its sign and mantissa bits are stored as they
are. Measured on SmolLM2-135M's cache (2,048 tokens, bf16, bits per element; keys / values):

* the exponent: 2.78 / 2.92 given nothing, 2.33 / 2.57 given its channel, 2.41 / 2.79 given the
  same channel's previous token, 2.17 / 2.51 given both, 2.78 / 2.83 given the neighbouring
  channel (little gain: channels are not ordered by scale);
* the sign and the top two mantissa bits: 2.95 / 2.95 of 3 given the exponent, 2.70 / 2.77 given
  the exponent and the channel; the keys' sign alone falls from 0.84 to 0.59 bits once the same
  channel's previous sign is known too (plausibly RoPE's slow channels, which turn little per
  token);
* the other mantissa bits: 4.90 / 5.00 of 5 given the exponent, so they are not modelled.

So a channel (a "lane": one ``(..., d)`` of the ``[..., S, D]`` tensor) is coded token by token
with two adaptive models whose counts start at zero and grow as the coder goes (the decoder
grows the same counts from what it has decoded, so no table is stored):

* the exponent, as a code ``top - exponent`` (``top``: the lane's largest exponent, one byte a
  lane; codes from ``K - 1`` on, and exponent fields of 0, are an escape whose exponent is listed
  apart, zlib-compressed), given the lane's previous code: the lane's counts for that previous
  code, plus the lane's counts for any previous code, plus all lanes' counts for that previous code
  (normalized to a fixed mass) so that a lane's first tokens are coded with what the others
  taught;
* the sign and the top two mantissa bits (8 symbols), given the lane, the exponent code just
  coded and the lane's previous sign, mixed the same way;
* the remaining mantissa bits (bf16: 5, fp16: 8) are packed as they are.

The counts are integers held in float32 (exact below 2**24) and every sum of them is exact, so
encoder and decoder build identical probability tables on any machine; ``constriction``'s range
coder turns them into bits. A CRC-32 of the original bits, checked after decoding, turns any
disagreement (a damaged byte string, a different ``constriction`` quantizing the tables another
way) into a ``KVDataError`` instead of a different tensor.

The coder steps through the tokens in Python, each step a handful of numpy operations over all
lanes at once, so it is much slower than ``ExponentCoder`` and wants many lanes per call:
:meth:`ContextCoder.encode_many` codes tensors of the same length and dtype together (a whole
cache's keys and values). ``docs/flashcodec.md`` has its measured sizes and speeds beside
``ExponentCoder``'s.

Needs the ``lossless`` extra: ``pip install "flashcodec-kv[lossless]"`` (``constriction``).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError

from .lossless import FORMATS

__all__ = ["ContextCoder", "require_constriction", "MAGIC"]

MAGIC = b"FCCX1"
_INSTALL_HINT = 'pip install "flashcodec-kv[lossless]" (or pip install "constriction>=0.5,<0.6")'
#: symbols of the sign + top-two-mantissa-bits model
_SIGN_SYMBOLS = 8
#: the previous-sign context before a lane's first token
_NO_SIGN = 2


def require_constriction():
    """The ``constriction`` module, or ``ImportError`` saying how to install it."""
    try:
        import constriction
    except ImportError:
        raise ImportError(
            f"the context lossless coder needs the constriction package (its range coder): {_INSTALL_HINT}"
        ) from None
    return constriction


def _constriction_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("constriction")
    except PackageNotFoundError:
        return "unknown"


def _pack_bits(values: np.ndarray, width: int) -> bytes:
    """``values`` (uint, each < 2**width, width <= 8) as ``width`` bits each, 8 values to ``width`` bytes."""
    n = values.size
    v = np.zeros(-(-n // 8) * 8, np.uint16)
    v[:n] = values
    v = v.reshape(-1, 8).T.astype(np.uint64)  # one contiguous row per position in the 8
    word = np.zeros(v.shape[1], np.uint64)
    for i in range(8):
        word |= v[i] << np.uint64(width * i)
    return word.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :width].tobytes()


def _unpack_bits(data: bytes, width: int, n: int) -> np.ndarray:
    rows = -(-n // 8)
    if len(data) != rows * width:
        raise KVDataError(
            f"data is damaged: the packed mantissa bits are {len(data)} bytes, {rows * width} expected"
        )
    raw = np.zeros((rows, 8), np.uint8)
    raw[:, :width] = np.frombuffer(data, np.uint8).reshape(rows, width)
    word = raw.view("<u8").reshape(rows)
    mask = np.uint64((1 << width) - 1)
    out = np.empty((rows, 8), np.uint16)
    for i in range(8):
        out[:, i] = (word >> np.uint64(width * i)) & mask
    return out.reshape(-1)[:n]


class _Models:
    """The two adaptive models' counts over ``lanes`` lanes; :meth:`exponent_rows` /
    :meth:`sign_rows` give one probability row a lane for the next token, :meth:`update` counts it."""

    def __init__(self, lanes: int, k: int, lane_weight: int, shared_weight: int, shared_mass: int):
        self.k, self.lanes = k, lanes
        self.w_ctx, self.w_lane, self.mass = float(lane_weight), float(shared_weight), float(shared_mass)
        self.lane = np.arange(lanes)
        # exponent: rows lane * (k + 1) + previous code (k: none yet)
        self.e_ctx = np.zeros((lanes * (k + 1), k), np.float32)
        self.e_lane = np.zeros((lanes, k), np.float32)
        self.e_all = np.zeros((k + 1, k), np.float64)
        # sign + mantissa: rows (lane * k + code) * 3 + previous sign (2: none yet)
        self.s_ctx = np.zeros((lanes * k * 3, _SIGN_SYMBOLS), np.float32)
        self.s_lane = np.zeros((lanes * k, _SIGN_SYMBOLS), np.float32)
        # all lanes': rows (code * 3 + previous sign) * (k + 1) + previous code
        self.s_all = np.zeros((k * 3 * (k + 1), _SIGN_SYMBOLS), np.float64)
        self.prev_code = np.full(lanes, k, np.int64)
        self.prev_sign = np.full(lanes, _NO_SIGN, np.int64)

    def _shared(self, table: np.ndarray, rows: np.ndarray) -> np.ndarray:
        # all lanes' counts scaled to a fixed mass: exact integer sums, so the same on every machine
        scaled = np.floor(table * self.mass / (table.sum(axis=1, keepdims=True) + 1.0)) + 1.0
        return np.take(scaled.astype(np.float32), rows, axis=0)

    def exponent_rows(self) -> np.ndarray:
        self._e_rows = self.lane * (self.k + 1) + self.prev_code
        p = np.take(self.e_ctx, self._e_rows, axis=0)
        p += self.e_lane
        p += self._shared(self.e_all, self.prev_code)
        return p

    def sign_rows(self, code: np.ndarray) -> np.ndarray:
        self._s_lane_rows = self.lane * self.k + code
        self._s_rows = self._s_lane_rows * 3 + self.prev_sign
        self._s_all_rows = (code * 3 + self.prev_sign) * (self.k + 1) + self.prev_code
        p = np.take(self.s_ctx, self._s_rows, axis=0)
        p += np.take(self.s_lane, self._s_lane_rows, axis=0)
        p += self._shared(self.s_all, self._s_all_rows)
        return p

    def update(self, code: np.ndarray, sign_symbol: np.ndarray) -> None:
        k = self.k
        # flat indices: one element a lane, so no index repeats within a call
        self.e_ctx.reshape(-1)[self._e_rows * k + code] += self.w_ctx
        self.e_lane.reshape(-1)[self.lane * k + code] += self.w_lane
        self.e_all += np.bincount(self.prev_code * k + code, minlength=(k + 1) * k).reshape(k + 1, k)
        self.s_ctx.reshape(-1)[self._s_rows * _SIGN_SYMBOLS + sign_symbol] += self.w_ctx
        self.s_lane.reshape(-1)[self._s_lane_rows * _SIGN_SYMBOLS + sign_symbol] += self.w_lane
        self.s_all += np.bincount(
            self._s_all_rows * _SIGN_SYMBOLS + sign_symbol, minlength=self.s_all.size
        ).reshape(self.s_all.shape)
        self.prev_code = code
        self.prev_sign = sign_symbol >> 2


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise KVConfigError(f"{name} must be an integer {low}..{high}; got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ContextCoder:
    """Bit-exact context-model coder of bf16 / fp16 ``[..., S, D]`` tensors to bytes (see the
    module docstring).

    Args:
        codes: exponent codes ``top - exponent`` the model tells apart, the escape included (4..64,
            default 16); larger ones, and zeros / subnormals, are escapes whose exponents are
            listed apart. Fewer codes teach each context faster: on SmolLM2's cache 16 codes
            beat 24 (0.639x against 0.641x at 1,024 tokens) and step faster.
        lane_weight: what one token adds to its lane's count in its context (1..1024; default 4).
        shared_weight: what it adds to its lane's count in any context (default 1).
        shared_mass: the mass all lanes' normalized counts add to every row (default 256; 16
            gave 0.639x, 256 0.635x on the cache above).

    The parameters are written into the bytes, so :meth:`decode` needs no coder object.
    """

    codes: int = 16
    lane_weight: int = 4
    shared_weight: int = 1
    shared_mass: int = 256

    def __post_init__(self) -> None:
        _check_int("codes", self.codes, 4, 64)
        _check_int("lane_weight", self.lane_weight, 1, 1024)
        _check_int("shared_weight", self.shared_weight, 0, 1024)
        _check_int("shared_mass", self.shared_mass, 1, 1 << 16)

    # ------------------------------------------------------------------ encoding
    def encode(self, x: torch.Tensor) -> bytes:
        """``x [..., S, D]`` bf16 or fp16 -> bytes (:meth:`decode` gives ``x`` back bit for bit)."""
        return self.encode_many([x])

    def encode_many(self, tensors: Sequence[torch.Tensor]) -> bytes:
        """Tensors of one dtype and one length ``S`` (``[..., S, D]`` each, any leading shape and
        ``D``), coded together: every channel of every tensor is a lane of one model."""
        constriction = require_constriction()
        tensors = list(tensors) if not isinstance(tensors, torch.Tensor) else [tensors]
        if not tensors:
            raise KVShapeError("tensors must hold at least one tensor")
        for i, x in enumerate(tensors):
            if not isinstance(x, torch.Tensor):
                raise KVDtypeError(f"tensors[{i}] must be a torch.Tensor; got {type(x).__name__}")
            if x.dtype not in FORMATS:
                raise KVDtypeError(
                    f"tensors[{i}] must be bfloat16 or float16 (a lossless 16-bit code); got {x.dtype}"
                )
            if x.dim() < 2 or x.shape[-1] < 1 or x.shape[-2] < 1:
                raise KVShapeError(
                    f"tensors[{i}] must be [..., S, D] with S, D >= 1; got shape {tuple(x.shape)}"
                )
            if x.dtype != tensors[0].dtype or x.shape[-2] != tensors[0].shape[-2]:
                raise KVShapeError(
                    f"tensors coded together must share dtype and length S: tensors[0] is "
                    f"{tensors[0].dtype} S={tensors[0].shape[-2]}, tensors[{i}] {x.dtype} S={x.shape[-2]}"
                )
        dtype = tensors[0].dtype
        e_bits, m_bits = FORMATS[dtype]
        steps = tensors[0].shape[-2]
        # [S, lanes], lanes in each tensor's (..., D) order, tensors one after another
        bits = np.concatenate(
            [
                x.detach()
                .cpu()
                .reshape(-1, steps, x.shape[-1])
                .transpose(0, 1)
                .reshape(steps, -1)
                .contiguous()
                .view(torch.int16)
                .numpy()
                .view(np.uint16)
                for x in tensors
            ],
            axis=1,
        )
        lanes = bits.shape[1]
        k = self.codes
        # narrow types for the whole-tensor arrays (memory traffic); intp rows only inside a step
        exponent = ((bits >> m_bits) & ((1 << e_bits) - 1)).astype(np.uint8)
        top = exponent.max(axis=0)
        offset = top[None, :].astype(np.int16) - exponent
        escape = (offset >= k - 1) | (exponent == 0)
        code = np.where(escape, k - 1, offset).astype(np.int32)  # constriction takes int32 symbols
        sign_symbol = (((bits >> 13) & 4) | ((bits >> (m_bits - 2)) & 3)).astype(np.int32)
        low = bits & ((1 << (m_bits - 2)) - 1)

        models = _Models(lanes, k, self.lane_weight, self.shared_weight, self.shared_mass)
        family = constriction.stream.model.Categorical(perfect=False)
        e_coder = constriction.stream.queue.RangeEncoder()
        s_coder = constriction.stream.queue.RangeEncoder()
        for t in range(steps):
            c32, s32 = code[t], sign_symbol[t]
            c = c32.astype(np.intp)
            e_coder.encode(c32, family, models.exponent_rows())
            s_coder.encode(s32, family, models.sign_rows(c))
            models.update(c, s32.astype(np.intp))
        e_words = e_coder.get_compressed().astype("<u4").tobytes()
        s_words = s_coder.get_compressed().astype("<u4").tobytes()
        parts = {
            "top": top.astype(np.uint8).tobytes(),
            "escapes": zlib.compress(exponent[escape].astype(np.uint8).tobytes(), 6),
            "mantissa": _pack_bits(low.reshape(-1), m_bits - 2),
            "exponent_words": e_words,
            "sign_words": s_words,
        }
        header = json.dumps(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "shapes": [list(x.shape) for x in tensors],
                "model": [k, self.lane_weight, self.shared_weight, self.shared_mass],
                "escapes": int(escape.sum()),
                "parts": {name: len(blob) for name, blob in parts.items()},
                "crc32": zlib.crc32(bits.astype("<u2").tobytes()),
                "constriction": _constriction_version(),
            }
        ).encode()
        return b"".join([MAGIC, len(header).to_bytes(4, "little"), header, *parts.values()])

    # ------------------------------------------------------------------ decoding
    @staticmethod
    def decode(data: bytes) -> torch.Tensor:
        """The tensor :meth:`encode` coded, bit for bit (CPU); ``KVDataError`` on other bytes."""
        tensors = ContextCoder.decode_many(data)
        if len(tensors) != 1:
            raise KVDataError(f"data holds {len(tensors)} tensors; decode_many reads them")
        return tensors[0]

    @staticmethod
    def decode_many(data: bytes) -> list[torch.Tensor]:
        """The tensors :meth:`encode_many` coded, bit for bit (CPU)."""
        constriction = require_constriction()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise KVDtypeError(f"data must be bytes; got {type(data).__name__}")
        data = bytes(data)
        if not data.startswith(MAGIC):
            raise KVDataError(
                f"data is not a context-coded tensor (bad magic {data[:5]!r}; expected {MAGIC!r})"
            )
        meta, parts = _read_header(data)
        dtype = getattr(torch, meta["dtype"])
        e_bits, m_bits = FORMATS[dtype]
        shapes = meta["shapes"]
        steps = shapes[0][-2]
        widths = [int(np.prod(s[:-2], dtype=np.int64)) * s[-1] for s in shapes]
        lanes = sum(widths)
        k, lane_weight, shared_weight, shared_mass = meta["model"]
        ContextCoder(k, lane_weight, shared_weight, shared_mass)  # checks the ranges
        n = steps * lanes
        if len(parts["top"]) != lanes:
            raise KVDataError(f"data is damaged: {len(parts['top'])} lane maxima for {lanes} lanes")
        top = np.frombuffer(parts["top"], np.uint8)
        try:
            e_words = np.frombuffer(parts["exponent_words"], "<u4").astype(np.uint32)
            s_words = np.frombuffer(parts["sign_words"], "<u4").astype(np.uint32)
            escaped = np.frombuffer(zlib.decompress(parts["escapes"]), np.uint8)
        except (ValueError, zlib.error) as err:
            raise KVDataError(f"data is damaged: {err}") from None
        low = _unpack_bits(parts["mantissa"], m_bits - 2, n).reshape(steps, lanes)

        models = _Models(lanes, k, lane_weight, shared_weight, shared_mass)
        family = constriction.stream.model.Categorical(perfect=False)
        e_coder = constriction.stream.queue.RangeDecoder(e_words)
        s_coder = constriction.stream.queue.RangeDecoder(s_words)
        code = np.empty((steps, lanes), np.uint8)
        sign_symbol = np.empty((steps, lanes), np.uint8)
        try:
            for t in range(steps):
                c = e_coder.decode(family, models.exponent_rows()).astype(np.intp)
                s = s_coder.decode(family, models.sign_rows(c)).astype(np.intp)
                models.update(c, s)
                code[t], sign_symbol[t] = c, s
        except (ValueError, RuntimeError, OverflowError) as err:
            raise KVDataError(f"data is damaged: the range decoder failed ({err})") from None
        # an escape's slot may go below 0 here: it is overwritten with the listed exponent next
        exponent = top[None, :].astype(np.int16) - code
        escape = code == k - 1
        if int(escape.sum()) != escaped.size or escaped.size != meta["escapes"]:
            raise KVDataError(
                f"data is damaged: {int(escape.sum())} escaped exponents decoded, {escaped.size} listed"
            )
        exponent[escape] = escaped
        u16 = np.uint16
        bits = (
            ((sign_symbol >> 2).astype(u16) << u16(15))
            | (exponent.astype(u16) << u16(m_bits))
            | ((sign_symbol & 3).astype(u16) << u16(m_bits - 2))
            | low
        )
        if zlib.crc32(bits.astype("<u2").tobytes()) != meta["crc32"]:
            raise KVDataError(
                "data is damaged or was coded by another constriction: the decoded bits fail their CRC-32 "
                f"(written with constriction {meta.get('constriction')}, read with {_constriction_version()})"
            )
        out, at = [], 0
        for shape, width in zip(shapes, widths, strict=True):
            lead = shape[:-2]
            chunk = torch.from_numpy(bits[:, at : at + width].view(np.int16).copy())
            at += width
            x = chunk.reshape(steps, -1, shape[-1]).transpose(0, 1).reshape(*lead, steps, shape[-1])
            out.append(x.contiguous().view(dtype))
        return out


_PARTS = ("top", "escapes", "mantissa", "exponent_words", "sign_words")
_DTYPES = {str(d).removeprefix("torch.") for d in FORMATS}


def _read_header(data: bytes) -> tuple[dict, dict[str, bytes]]:
    """The header and the named parts of ``data``, after checking that they describe it exactly."""
    where = "data is a damaged context-coded tensor:"
    try:
        n = int.from_bytes(data[5:9], "little")
        meta = json.loads(data[9 : 9 + n])
    except (ValueError, UnicodeDecodeError) as err:
        raise KVDataError(f"{where} unreadable header ({err})") from None
    if not isinstance(meta, dict):
        raise KVDataError(f"{where} the header is not an object")
    shapes = meta.get("shapes")
    ok = (
        isinstance(shapes, list)
        and shapes
        and all(
            isinstance(s, list) and len(s) >= 2 and all(type(d) is int and d >= 1 for d in s) for s in shapes
        )
    )
    if not ok or len({s[-2] for s in shapes}) != 1:
        raise KVDataError(
            f"{where} 'shapes' must list [..., S, D] shapes (ints >= 1) of one S; got {shapes!r:.80}"
        )
    if meta.get("dtype") not in _DTYPES:
        raise KVDataError(f"{where} 'dtype' must be one of {sorted(_DTYPES)}; got {meta.get('dtype')!r}")
    model = meta.get("model")
    if not (isinstance(model, list) and len(model) == 4 and all(type(v) is int for v in model)):
        raise KVDataError(f"{where} 'model' must be 4 integers; got {model!r:.80}")
    sizes = meta.get("parts")
    if not (isinstance(sizes, dict) and list(sizes) == list(_PARTS)) or not all(
        type(sizes[p]) is int and sizes[p] >= 0 for p in _PARTS
    ):
        raise KVDataError(f"{where} 'parts' must give the byte counts of {list(_PARTS)}; got {sizes!r:.80}")
    if type(meta.get("crc32")) is not int or type(meta.get("escapes")) is not int:
        raise KVDataError(f"{where} 'crc32' and 'escapes' must be integers")
    at = 9 + n
    if at + sum(sizes.values()) != len(data):
        raise KVDataError(
            f"{where} its header describes {sum(sizes.values())} bytes of parts, {len(data) - at} follow it"
        )
    parts = {}
    for name in _PARTS:
        parts[name] = data[at : at + sizes[name]]
        at += sizes[name]
    return meta, parts
