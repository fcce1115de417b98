"""KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"),
written in plain MLX as a reference peer that really holds its codes.

* keys: quantized per channel, over groups of ``group`` tokens (one scale and zero per channel
  and group: key outliers sit in a few channels);
* values: quantized per token, in groups of ``group`` channels;
* asymmetric: ``x ~ code * scale + zero``, scale and zero in float16, codes of ``bits`` bits
  packed ``8 // bits`` to a uint8;
* a residual window of the newest tokens stays in 16 bits; whole groups of ``group`` tokens
  leave it for the codes once it holds ``residual`` tokens (with ``residual == group``, as
  here, the window holds 0 to ``group - 1`` tokens, as in the KIVI reference code).

The cache keeps only codes, scales, zeros and the window. ``update_and_fetch`` decodes the
whole history into a transient for attention each step: the reference is about what is held
and what attention sees, not about speed.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from . import Peer, PeerUnavailable, plain_layers

__all__ = ["KIVICache", "quantize_keys", "quantize_values", "dequantize_keys", "dequantize_values"]

_CODE_BITS = (2, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in _CODE_BITS:
        raise ValueError(f"KIVI bits must be one of {_CODE_BITS}; got {bits!r}")


def _pack(codes: mx.array, bits: int) -> mx.array:
    """uint8 codes (< 2**bits) along the last axis -> ``8 // bits`` codes per byte."""
    per = 8 // bits
    if per == 1:
        return codes.astype(mx.uint8)
    shifts = mx.arange(per, dtype=mx.uint32) * bits
    grouped = codes.astype(mx.uint32).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    return (grouped << shifts).sum(axis=-1).astype(mx.uint8)


def _unpack(packed: mx.array, bits: int) -> mx.array:
    per = 8 // bits
    if per == 1:
        return packed
    shifts = mx.arange(per, dtype=mx.uint8) * bits
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _affine(x: mx.array, axis: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Codes, scale and zero (float16) of ``x`` (float32) grouped over ``axis``; the codes are
    fitted to the float16-rounded scale and zero, so decoding errs by at most half a step plus
    the zero's rounding."""
    levels = (1 << bits) - 1
    lo = x.min(axis=axis, keepdims=True)
    hi = x.max(axis=axis, keepdims=True)
    zero = lo.astype(mx.float16)
    scale = ((hi - zero.astype(mx.float32)) / levels).astype(mx.float16)
    s = scale.astype(mx.float32)
    safe = mx.where(s > 0, s, 1.0)
    codes = mx.clip(mx.round((x - zero.astype(mx.float32)) / safe), 0, levels).astype(mx.uint8)
    return codes, scale, zero


def quantize_keys(k: mx.array, bits: int, group: int) -> tuple[mx.array, mx.array, mx.array]:
    """Keys ``[B, H, N, D]`` (N a multiple of ``group``) -> packed codes ``[B, H, N, D*bits/8]``
    and per-channel scale / zero ``[B, H, N/group, D]`` (float16)."""
    B, H, N, D = k.shape
    x = k.astype(mx.float32).reshape(B, H, N // group, group, D)
    codes, scale, zero = _affine(x, axis=3, bits=bits)
    return _pack(codes.reshape(B, H, N, D), bits), scale.squeeze(3), zero.squeeze(3)


def quantize_values(v: mx.array, bits: int, group: int) -> tuple[mx.array, mx.array, mx.array]:
    """Values ``[B, H, N, D]`` (D a multiple of ``group``) -> packed codes and per-token scale /
    zero ``[B, H, N, D/group]`` (float16)."""
    B, H, N, D = v.shape
    x = v.astype(mx.float32).reshape(B, H, N, D // group, group)
    codes, scale, zero = _affine(x, axis=4, bits=bits)
    return _pack(codes.reshape(B, H, N, D), bits), scale.squeeze(4), zero.squeeze(4)


def dequantize_keys(packed: mx.array, scale: mx.array, zero: mx.array, bits: int, group: int) -> mx.array:
    """The float32 keys :func:`quantize_keys` encoded."""
    codes = _unpack(packed, bits).astype(mx.float32)
    B, H, N, D = codes.shape
    x = codes.reshape(B, H, N // group, group, D) * scale[:, :, :, None].astype(mx.float32)
    return (x + zero[:, :, :, None].astype(mx.float32)).reshape(B, H, N, D)


def dequantize_values(packed: mx.array, scale: mx.array, zero: mx.array, bits: int, group: int) -> mx.array:
    """The float32 values :func:`quantize_values` encoded."""
    codes = _unpack(packed, bits).astype(mx.float32)
    B, H, N, D = codes.shape
    x = codes.reshape(B, H, N, D // group, group) * scale[..., None].astype(mx.float32)
    return (x + zero[..., None].astype(mx.float32)).reshape(B, H, N, D)


class KIVICache(_BaseCache):
    """One layer's KIVI cache (mlx-lm's cache protocol: ``update_and_fetch``, ``offset``,
    ``state`` / ``meta_state``, ``make_mask``, ``nbytes``).

    ``key_bits`` / ``value_bits``: 2, 4 or 8; ``group``: tokens per key group and channels per
    value group (the head dim must be a multiple); ``residual``: a multiple of ``group``, the
    window length at which whole groups leave the window (the window keeps at least
    ``residual - group`` tokens). It has no ``bits`` attribute on purpose: mlx-lm sends caches
    that have one to its quantized attention kernel, which these codes are not laid out for.
    """

    def __init__(self, key_bits: int = 4, value_bits: int = 4, group: int = 32, residual: int = 32):
        _check_bits(key_bits)
        _check_bits(value_bits)
        if not isinstance(group, int) or group < 1:
            raise ValueError(f"KIVI group must be a positive int; got {group!r}")
        if not isinstance(residual, int) or residual < group or residual % group:
            raise ValueError(f"KIVI residual must be a positive multiple of group={group}; got {residual!r}")
        self.key_bits, self.value_bits = key_bits, value_bits
        self.group, self.residual = group, residual
        self.offset = 0
        # codes, scales and zeros of the tokens that left the window (None: none yet)
        self.k_codes = self.k_scale = self.k_zero = None
        self.v_codes = self.v_scale = self.v_zero = None
        # the newest tokens in the model's 16-bit dtype
        self.k_window = self.v_window = None

    # ------------------------------------------------------------------ protocol
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"KIVICache: keys and values must be [B, heads, tokens, dim] with the same first "
                f"three axes; got {keys.shape} and {values.shape}"
            )
        if values.shape[-1] % self.group:
            raise ValueError(
                f"KIVICache: value dim {values.shape[-1]} is not a multiple of group={self.group}"
            )
        if self.k_window is None:
            self.k_window, self.v_window = keys, values
        else:
            self.k_window = mx.concatenate([self.k_window, keys], axis=2)
            self.v_window = mx.concatenate([self.v_window, values], axis=2)
        self.offset += keys.shape[2]
        self._flush()
        k, v = self._decoded()
        return k, v

    def _flush(self) -> None:
        held = self.k_window.shape[2]
        if held < self.residual:
            return
        n = ((held - (self.residual - self.group)) // self.group) * self.group
        kq = quantize_keys(self.k_window[:, :, :n], self.key_bits, self.group)
        vq = quantize_values(self.v_window[:, :, :n], self.value_bits, self.group)
        # a gather, not a slice: a slice would keep the flushed tokens' 16-bit buffer alive
        # under the view, held but not counted
        keep = mx.arange(n, held)
        self.k_window = mx.take(self.k_window, keep, axis=2)
        self.v_window = mx.take(self.v_window, keep, axis=2)
        if self.k_codes is None:
            self.k_codes, self.k_scale, self.k_zero = kq
            self.v_codes, self.v_scale, self.v_zero = vq
        else:
            self.k_codes, self.k_scale, self.k_zero = (
                mx.concatenate([a, b], axis=2)
                for a, b in zip((self.k_codes, self.k_scale, self.k_zero), kq, strict=True)
            )
            self.v_codes, self.v_scale, self.v_zero = (
                mx.concatenate([a, b], axis=2)
                for a, b in zip((self.v_codes, self.v_scale, self.v_zero), vq, strict=True)
            )
        mx.eval(self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero)
        mx.eval(self.k_window, self.v_window)

    def _decoded(self) -> tuple[mx.array, mx.array]:
        """The whole history, decoded codes then the window, in the window's dtype: a transient
        for attention, never stored."""
        if self.k_codes is None:
            return self.k_window, self.v_window
        dtype = self.k_window.dtype
        k = dequantize_keys(self.k_codes, self.k_scale, self.k_zero, self.key_bits, self.group).astype(dtype)
        v = dequantize_values(self.v_codes, self.v_scale, self.v_zero, self.value_bits, self.group).astype(
            self.v_window.dtype
        )
        return mx.concatenate([k, self.k_window], axis=2), mx.concatenate([v, self.v_window], axis=2)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.k_window is None

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def is_trimmable(self) -> bool:
        # codes of a group cannot drop tokens without re-fitting the group
        return False

    @property
    def quantized_tokens(self) -> int:
        return 0 if self.k_codes is None else int(self.k_codes.shape[2])

    @property
    def window_tokens(self) -> int:
        return 0 if self.k_window is None else int(self.k_window.shape[2])

    def _arrays(self) -> list[mx.array]:
        names = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_window", "v_window")
        return [a for a in (getattr(self, n) for n in names) if a is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of every array the cache keeps: packed codes, float16 scales and zeros, window."""
        return sum(int(a.nbytes) for a in self._arrays())

    @property
    def state(self) -> list[mx.array]:
        if self.k_window is None:
            return []
        if self.k_codes is None:
            return [self.k_window, self.v_window]
        return [self.k_window, self.v_window, self.k_codes, self.k_scale, self.k_zero,
                self.v_codes, self.v_scale, self.v_zero]  # fmt: skip

    @state.setter
    def state(self, v: list[mx.array]) -> None:
        if not v:
            self.k_window = self.v_window = None
            self.k_codes = self.k_scale = self.k_zero = self.v_codes = self.v_scale = self.v_zero = None
        elif len(v) == 2:
            self.k_window, self.v_window = v
            self.k_codes = self.k_scale = self.k_zero = self.v_codes = self.v_scale = self.v_zero = None
        elif len(v) == 8:
            (self.k_window, self.v_window, self.k_codes, self.k_scale, self.k_zero,
             self.v_codes, self.v_scale, self.v_zero) = v  # fmt: skip
        else:
            raise ValueError(f"KIVICache.state takes 0, 2 or 8 arrays; got {len(v)}")

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(map(str, (self.key_bits, self.value_bits, self.group, self.residual, self.offset)))

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        if len(v) != 5:
            raise ValueError(f"KIVICache.meta_state takes 5 values; got {v!r}")
        kb, vb, group, residual, offset = map(int, v)
        _check_bits(kb)
        _check_bits(vb)
        self.key_bits, self.value_bits, self.group, self.residual, self.offset = (
            kb,
            vb,
            group,
            residual,
            offset,
        )


def _peer(name: str, bits: int, group: int = 32, residual: int = 32) -> Peer:
    def make(model: Any) -> list[Any]:
        from ..builder import model_kv_dims

        head_dim, _ = model_kv_dims(model)
        if head_dim is None:
            raise PeerUnavailable("cannot read the head dim from the model's args")
        if head_dim % group or head_dim % (8 // bits):
            raise PeerUnavailable(f"head dim {head_dim} is not a multiple of the value group {group}")
        return plain_layers(model, lambda: KIVICache(bits, bits, group, residual))

    return Peer(
        name,
        f"KIVI in plain MLX, {bits}-bit keys per channel / values per token, groups of {group}, "
        f"16-bit residual window (whole groups leave it at {residual} tokens)",
        make,
        {
            "class": "palu_mlx.peers.kivi.KIVICache",
            "key_bits": bits,
            "value_bits": bits,
            "group": group,
            "residual": residual,
            "scale_zero": "float16",
        },
    )


PEERS = [_peer("kivi-k4v4", 4), _peer("kivi-k2v2", 2)]
