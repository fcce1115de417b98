"""The comparison baseline: uniform group quantization of the full keys and values.

Every token's ``D`` channels are cut into groups of ``group_size`` and coded
with ``mx.quantize`` (affine, ``bits`` per element plus one scale and one bias
per group in the input dtype). No low-rank step, no mixed bits: this is what
palu has to beat per byte.

Like :class:`~palu_mlx.cache.PaluKVCache` it returns dequantized K/V to the
model and has no ``bits`` attribute (mlx-lm would route it to quantized
attention); the bit width is :attr:`NaiveQuantKVCache.quant_bits`.
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
from kvspec import KVConfigError, KVDtypeError, KVShapeError, KVValueError, check_kv_pair, trim_count
from mlx_lm.models.cache import create_attention_mask

from .cache import SUPPORTED_DTYPES, dtype_from_name, dtype_name, write_rows
from .config import PACKABLE_BITS

__all__ = ["NaiveQuantKVCache", "naive_roundtrip"]

_FIELDS = ("codes", "scales", "biases")


def _check_quant(bits: int, group_size: int) -> None:
    if bits not in PACKABLE_BITS or isinstance(bits, bool):
        raise KVConfigError(f"bits={bits!r} cannot be packed; allowed: {PACKABLE_BITS}")
    if group_size not in (32, 64, 128) or isinstance(group_size, bool):
        raise KVConfigError(f"group_size={group_size!r} must be 32, 64 or 128 (mx.quantize group sizes)")


def naive_roundtrip(x: mx.array, bits: int = 2, group_size: int = 64) -> tuple[mx.array, int]:
    """Quantize ``x [..., D]`` uniformly and dequantize it.

    Returns ``(x_hat [..., D] in x's dtype, bytes held by codes + scales + biases)``.
    ``D`` must be a multiple of ``group_size``.
    """
    _check_quant(bits, group_size)
    if x.shape[-1] % group_size:
        raise KVShapeError(f"last dim {x.shape[-1]} must be a multiple of group_size={group_size}")
    codes, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    x_hat = mx.dequantize(codes, scales, biases, group_size=group_size, bits=bits).astype(x.dtype)
    mx.eval(x_hat, codes, scales, biases)
    return x_hat, codes.nbytes + scales.nbytes + biases.nbytes


class NaiveQuantKVCache:
    """mlx-lm cache layer holding ``mx.quantize``-coded K/V ``[B, H, S, ·]`` (the baseline).

    Args:
        quant_bits: bits per element (1, 2, 3, 4, 5, 6, 8).
        group_size: 32, 64 or 128; must divide the head dims.
        check_finite: reject NaN / inf input (one device sync per call).
    """

    step = 256

    def __init__(self, quant_bits: int = 2, group_size: int = 64, check_finite: bool = True):
        _check_quant(quant_bits, group_size)
        self.quant_bits = quant_bits
        self.group_size = group_size
        self.check_finite = check_finite
        self.offset = 0
        self._shape: tuple[int, int, int, int] | None = None
        self._dtype: mx.Dtype | None = None
        self._keys: dict[str, mx.array] | None = None
        self._values: dict[str, mx.array] | None = None

    def _validate(self, keys: Any, values: Any) -> tuple[int, int, int, int, int]:
        if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
            raise KVDtypeError("keys and values must be mlx.core.array")
        b, h, s, d, dv = check_kv_pair(keys.shape, values.shape, keys.dtype, values.dtype, self._shape)
        if keys.dtype not in SUPPORTED_DTYPES:
            raise KVDtypeError(
                f"keys dtype {keys.dtype} is not supported; allowed: float16, bfloat16, float32"
            )
        if self._dtype is not None and keys.dtype != self._dtype:
            raise KVDtypeError(f"keys dtype {keys.dtype} differs from the cache's dtype {self._dtype}")
        if d % self.group_size or dv % self.group_size:
            raise KVShapeError(f"head dims ({d}, {dv}) must be multiples of group_size={self.group_size}")
        if self.check_finite:
            if not (mx.all(mx.isfinite(keys)) & mx.all(mx.isfinite(values))).item():
                raise KVValueError(
                    "keys or values contain NaN or infinity; the cache only accepts finite values"
                )
        return b, h, s, d, dv

    def _append(self, held: dict[str, mx.array] | None, x: mx.array, prev: int) -> dict[str, mx.array]:
        coded = mx.quantize(x, group_size=self.group_size, bits=self.quant_bits)
        held = held or {}
        return {
            name: write_rows(held.get(name), arr, prev, self.step)
            for name, arr in zip(_FIELDS, coded, strict=True)
        }

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``[B, H, S, D]`` keys/values; return all dequantized ``[B, H, offset, ·]`` in the input dtype."""
        b, h, s, d, dv = self._validate(keys, values)
        prev = self.offset
        self._keys = self._append(self._keys, keys, prev)
        self._values = self._append(self._values, values, prev)
        self._shape, self._dtype = (b, h, d, dv), keys.dtype
        self.offset = prev + s
        return self._dequantize(self._keys), self._dequantize(self._values)

    def _dequantize(self, held: dict[str, mx.array]) -> mx.array:
        n = self.offset
        codes, scales, biases = (held[f][..., :n, :] for f in _FIELDS)
        out = mx.dequantize(codes, scales, biases, group_size=self.group_size, bits=self.quant_bits)
        return out.astype(self._dtype)

    # mlx-lm interface
    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self._shape is None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = trim_count(n, self.offset)
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The attention mask for ``N`` new queries (same rules as mlx-lm's ``KVCache``)."""
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    @property
    def state(self) -> dict[str, mx.array]:
        if self._shape is None:
            return {}
        n = self.offset
        out = {f"key.{k}": v[..., :n, :] for k, v in self._keys.items()}
        out.update({f"value.{k}": v[..., :n, :] for k, v in self._values.items()})
        return out

    @property
    def meta_state(self) -> tuple[str, str]:
        settings = {
            "quant_bits": self.quant_bits,
            "group_size": self.group_size,
            "check_finite": self.check_finite,
        }
        runtime = {
            "class": type(self).__name__,
            "offset": self.offset,
            "shape": list(self._shape) if self._shape else None,
            "dtype": dtype_name(self._dtype) if self._dtype is not None else None,
        }
        return json.dumps(settings, sort_keys=True), json.dumps(runtime, sort_keys=True)

    @classmethod
    def from_state(
        cls, state: dict[str, mx.array], meta_state: tuple[str, str] | list[str]
    ) -> NaiveQuantKVCache:
        settings, runtime = json.loads(meta_state[0]), json.loads(meta_state[1])
        cache = cls(**settings)
        if runtime["shape"] is None:
            return cache
        cache._shape, cache._dtype = tuple(runtime["shape"]), dtype_from_name(runtime["dtype"])
        try:
            cache._keys = {f: write_rows(None, state[f"key.{f}"], 0, cls.step) for f in _FIELDS}
            cache._values = {f: write_rows(None, state[f"value.{f}"], 0, cls.step) for f in _FIELDS}
        except KeyError as missing:
            raise KVConfigError(f"state is missing array {missing}") from None
        cache.offset = int(runtime["offset"])
        return cache

    @property
    def nbytes(self) -> int:
        """Bytes of every array held (full grown capacity)."""
        return sum(a.nbytes for held in (self._keys or {}, self._values or {}) for a in held.values())

    @property
    def raw_nbytes(self) -> int:
        if self._shape is None:
            return 0
        b, h, d, dv = self._shape
        return b * h * self.offset * (d + dv) * self._dtype.size

    @property
    def effective_bits_per_element(self) -> float:
        if self._shape is None or self.offset == 0:
            return float("nan")
        b, h, d, dv = self._shape
        return 8.0 * self.nbytes / (b * h * self.offset * (d + dv))
