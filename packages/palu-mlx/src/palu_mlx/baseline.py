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

import mlx.core as mx
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError

from .config import PACKABLE_BITS
from .layer import SUPPORTED_DTYPES, CacheLayer, detached, write_rows
from .state_checks import StateArrays, parse_meta_state, read_runtime, split_state, with_meta

__all__ = ["NaiveQuantKVCache", "naive_roundtrip"]

_FIELDS = ("codes", "scales", "biases")


def _is_int(value) -> bool:
    # 2.0 == 2 and True == 1: a float or bool width is a caller's mistake, not a width
    return isinstance(value, int) and not isinstance(value, bool)


def _check_quant(bits: int, group_size: int, bits_name: str = "bits") -> None:
    if not _is_int(bits) or bits not in PACKABLE_BITS:
        raise KVConfigError(f"{bits_name}={bits!r} cannot be packed; allowed: {PACKABLE_BITS}")
    if not _is_int(group_size) or group_size not in (32, 64, 128):
        raise KVConfigError(f"group_size={group_size!r} must be 32, 64 or 128 (mx.quantize group sizes)")


def naive_roundtrip(x: mx.array, bits: int = 2, group_size: int = 64) -> tuple[mx.array, int]:
    """Quantize ``x [..., D]`` uniformly and dequantize it.

    Returns ``(x_hat [..., D] in x's dtype, bytes held by codes + scales + biases)``.
    ``D`` must be a multiple of ``group_size``.
    """
    _check_quant(bits, group_size)
    if not isinstance(x, mx.array) or x.dtype not in SUPPORTED_DTYPES:
        got = x.dtype if isinstance(x, mx.array) else type(x).__name__
        raise KVDtypeError(f"x must be an mlx float16, bfloat16 or float32 array; got {got}")
    if x.ndim < 1 or x.shape[-1] % group_size:
        raise KVShapeError(f"x's last dim must be a multiple of group_size={group_size}; got shape {x.shape}")
    codes, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    x_hat = mx.dequantize(codes, scales, biases, group_size=group_size, bits=bits).astype(x.dtype)
    mx.eval(x_hat, codes, scales, biases)
    return x_hat, codes.nbytes + scales.nbytes + biases.nbytes


class NaiveQuantKVCache(CacheLayer):
    """mlx-lm cache layer holding ``mx.quantize``-coded K/V ``[B, H, S, ·]`` (the baseline).

    Args:
        quant_bits: bits per element (1, 2, 3, 4, 5, 6, 8).
        group_size: 32, 64 or 128; must divide the head dims.
        check_finite: reject NaN / inf input (one device sync per call).
    """

    def __init__(self, quant_bits: int = 2, group_size: int = 64, check_finite: bool = True):
        _check_quant(quant_bits, group_size, "quant_bits")
        if not isinstance(check_finite, bool):
            raise KVConfigError(f"check_finite={check_finite!r} must be True or False")
        super().__init__()
        self.quant_bits = quant_bits
        self.group_size = group_size
        self.check_finite = check_finite
        self._keys: dict[str, mx.array] | None = None
        self._values: dict[str, mx.array] | None = None

    def _check_dims(self, h: int, d: int, dv: int) -> None:
        if d % self.group_size or dv % self.group_size:
            raise KVShapeError(f"head dims ({d}, {dv}) must be multiples of group_size={self.group_size}")

    def _append(self, held: dict[str, mx.array] | None, x: mx.array, prev: int) -> dict[str, mx.array]:
        coded = mx.quantize(x, group_size=self.group_size, bits=self.quant_bits)
        held = held or {}
        return {
            name: write_rows(held.get(name), arr, prev, self.step)
            for name, arr in zip(_FIELDS, coded, strict=True)
        }

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``[B, H, S, D]`` keys/values; return all dequantized ``[B, H, offset, ·]`` in the input dtype."""
        b, h, s, d, dv = self._validate(keys, values, self.check_finite)
        prev = self.offset
        # both tensors' buffers first, then commit: if the second fails (out of memory), the
        # first is not half-committed (its grown buffer would change nbytes)
        new_keys = self._append(self._keys, keys, prev)
        new_values = self._append(self._values, values, prev)
        self._keys, self._values = new_keys, new_values
        self._shape, self._dtype = (b, h, d, dv), keys.dtype
        self.offset = prev + s
        return self._dequantize(self._keys), self._dequantize(self._values)

    def _dequantize(self, held: dict[str, mx.array]) -> mx.array:
        n = self.offset
        codes, scales, biases = (held[f][..., :n, :] for f in _FIELDS)
        out = mx.dequantize(codes, scales, biases, group_size=self.group_size, bits=self.quant_bits)
        return out.astype(self._dtype)

    @property
    def state(self) -> dict[str, mx.array]:
        """``key.<field>`` and ``value.<field>`` (codes, scales, biases), cut to ``offset`` tokens, and
        ``meta_state`` (the :attr:`meta_state` and a checksum, as in :attr:`PaluKVCache.state`).

        Copies: writing into them (or into numpy views of them) cannot change the cache.
        """
        out: dict[str, mx.array] = {}
        if self._shape is not None:
            n = self.offset
            out = {f"key.{k}": detached(v[..., :n, :]) for k, v in self._keys.items()}
            out.update({f"value.{k}": detached(v[..., :n, :]) for k, v in self._values.items()})
        return with_meta(type(self).__name__, out, self.meta_state)

    @property
    def meta_state(self) -> tuple[str, str]:
        """``(settings JSON, runtime JSON)``: the constructor's arguments; offset, shape and dtype."""
        settings = {
            "quant_bits": self.quant_bits,
            "group_size": self.group_size,
            "check_finite": self.check_finite,
        }
        return json.dumps(settings, sort_keys=True), json.dumps(self._runtime(), sort_keys=True)

    @classmethod
    def from_state(
        cls, state: dict[str, mx.array], meta_state: tuple[str, str] | list[str] | None = None
    ) -> NaiveQuantKVCache:
        """Rebuild a cache from :attr:`state` and :attr:`meta_state`.

        Every array is checked against the metadata (names, shapes, dtypes, finite scales and
        biases) before anything is built: a mismatch raises ``KVDataError`` naming it.
        """
        owner = f"{cls.__name__}.from_state"
        state, meta_state = split_state(state, meta_state, cls.__name__, owner)
        settings, runtime = parse_meta_state(meta_state, owner)
        offset, shape, dtype = read_runtime(runtime, cls.__name__, owner)
        if set(settings) != {"quant_bits", "group_size", "check_finite"}:
            raise KVDataError(
                f"{owner}: meta_state settings must have exactly quant_bits, group_size, check_finite; "
                f"got {sorted(settings)}"
            )
        try:
            cache = cls(**settings)
        except KVConfigError as exc:
            raise KVDataError(f"{owner}: meta_state settings: {exc}") from None
        arrays = StateArrays(state, owner)
        if shape is None:
            arrays.finish()
            return cache
        b, h, d, dv = shape
        try:
            cache._check_dims(h, d, dv)
        except KVShapeError as exc:
            raise KVDataError(f"{owner}: meta_state shape {list(shape)}: {exc}") from None
        held = []
        for prefix, dim in (("key", d), ("value", dv)):
            # mx.quantize's own output on one row gives each field's width and dtype
            probe = mx.quantize(
                mx.zeros((1, dim), dtype=dtype), group_size=cache.group_size, bits=cache.quant_bits
            )
            held.append(
                {
                    f: arrays.take(f"{prefix}.{f}", (b, h, offset, p.shape[-1]), p.dtype)
                    for f, p in zip(_FIELDS, probe, strict=True)
                }
            )
        arrays.finish()
        cache._keys, cache._values = (
            {f: write_rows(None, a, 0, cls.step) for f, a in x.items()} for x in held
        )
        cache._shape, cache._dtype, cache.offset = shape, dtype, offset
        return cache

    @property
    def nbytes(self) -> int:
        """Bytes of every array held (full grown capacity)."""
        return sum(a.nbytes for held in (self._keys or {}, self._values or {}) for a in held.values())
