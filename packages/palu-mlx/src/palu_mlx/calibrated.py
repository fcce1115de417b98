"""A palu cache layer driven by a calibration file: fixed projections and fixed quantizers.

With a :class:`~palu_mlx.calibration.Calibration` nothing is fitted at run time: from the first
token, each KV head's keys (pre-RoPE where supported) and values are projected onto the head's
calibrated basis, each latent channel is coded by a fixed uniform scalar quantizer, and the codes
of one token and head are packed into a bitstream of whole bytes (behind one bfloat16 scale per
token and head with ``palu_token_scale``). The first ``palu_sink_tokens`` and newest
``palu_recent_tokens`` tokens are also held exactly (:mod:`palu_mlx.sinks`). The calibration
itself is a per-model constant, reported apart from the per-sequence bytes (``constant_nbytes``),
like the weights.

**Widths.** One reverse water-filling level across every layer, keys and values
(:func:`~palu_mlx.mixed_bit.water_fill` over the head-averaged latent variances) gives each
channel an integer width 0-8 for a budget of ``palu_bits`` code bits per original element;
0-bit channels are dropped, so each tensor's rank follows from the budget.

**Quantizer.** :class:`~palu_mlx.coders.fixed.FixedQuantCoder`: per channel a midrise uniform
quantizer of ``2^b`` levels whose step is the Gaussian-optimal one times the channel's calibrated
standard deviation, optionally stretched per token (``palu_token_scale``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError, KVDataError, KVShapeError

from .attention import LatentStore, PackedRows
from .calibration.file import Calibration, TensorCalibration
from .coders.fixed import GAUSSIAN_STEP, TOKEN_SCALE_BYTES, FixedQuantCoder, token_scales
from .config import DEFAULT_PALU_BITS, KVCacheConfig
from .layer import SUPPORTED_DTYPES, CacheLayer, detached, write_rows
from .lowrank import GroupProjection, project, reconstruct
from .mixed_bit import water_fill
from .rope import Rotary
from .sinks import ExactPrefix, RecentWindow, read_recent
from .state_checks import (
    StateArrays,
    parse_meta_state,
    read_config,
    read_field,
    read_rope,
    read_runtime,
    read_widths,
    split_state,
    with_meta,
)

__all__ = [
    "FixedQuantCoder",
    "CalibratedKVCache",
    "calibrated_caches",
    "GAUSSIAN_STEP",
    "TOKEN_SCALE_BYTES",
    "token_scales",
]


@dataclass(frozen=True)
class _TensorCode:
    projection: GroupProjection  # per KV head: n_groups = H
    coder: FixedQuantCoder

    def arrays(self) -> dict[str, mx.array]:
        # singular_values are left out of the state: from_state fills them with the steps
        out = {n: a for n, a in self.projection.arrays().items() if n != "singular_values"}
        return {**out, "steps": self.coder.steps}


def _tensor_code(t: TensorCalibration, widths: np.ndarray, token_scale: bool = False) -> _TensorCode:
    keep = int(np.count_nonzero(widths)) or 1
    widths = tuple(int(w) for w in widths[:keep]) if widths[0] > 0 else (1,)
    sigma = mx.sqrt(mx.maximum(t.variance[:, :keep], 1e-12))
    steps = sigma * mx.array([GAUSSIAN_STEP[w] for w in widths], dtype=mx.float32)
    basis = mx.contiguous(t.basis[:, :, :keep])
    decoder = None if t.decoder is None else mx.contiguous(t.decoder[:, :, :keep])
    projection = GroupProjection(
        basis=basis, mean=t.mean, singular_values=t.variance[:, :keep], decoder=decoder
    )
    return _TensorCode(projection, FixedQuantCoder(widths, steps, token_scale))


def allocate_widths(calibration: Calibration, bits: float) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Per layer ``(key widths [D], value widths [Dv])`` from one water-filling level (None: not cached)."""
    tensors, dims = [], 0
    for k, v in zip(calibration.keys, calibration.values, strict=True):
        if k is not None:
            tensors += [np.array(k.variance).mean(axis=0), np.array(v.variance).mean(axis=0)]
            dims += k.basis.shape[1] + v.basis.shape[1]
    widths = iter(water_fill(tensors, int(round(bits * dims))))
    return [None if k is None else (next(widths), next(widths)) for k in calibration.keys]


class CalibratedKVCache(CacheLayer):
    """One layer's palu cache from a calibration: fixed per-head projections and quantizers.

    Args:
        config: the :class:`KVCacheConfig` (its ``palu_calibration`` and ``palu_bits``).
        key, value: the layer's coders (see :func:`calibrated_caches`).
        rotary: the layer's RoPE when keys were calibrated before RoPE.
    """

    def __init__(self, config: KVCacheConfig, key: _TensorCode, value: _TensorCode, rotary: Rotary | None):
        super().__init__()
        self.config = config
        self._key, self._value, self.rotary = key, value, rotary
        self._key_codes: mx.array | None = None
        self._value_codes: mx.array | None = None
        self._sinks = ExactPrefix(config.palu_sink_tokens)
        self._recent = RecentWindow(config.palu_recent_tokens)

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (clamped to ``offset``); returns how many were dropped."""
        n = super().trim(n)
        self._recent = self._recent.cut(self.offset)  # no stale exact rows held
        return n

    def _check_dims(self, h: int, d: int, dv: int) -> None:
        want = (self._key.projection.n_groups, self._key.projection.dim, self._value.projection.dim)
        if (h, d, dv) != want:
            raise KVShapeError(
                f"keys/values with (heads, D, Dv)={(h, d, dv)} do not match the calibration's {want}"
            )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys [B, H, S, D]`` / ``values [B, H, S, Dv]``; returns all ``offset`` tokens, input dtype."""
        b, h, _, d, dv = self._validate(keys, values, self.config.palu_check_finite)
        prev = self.offset
        k = keys if self.rotary is None else self.rotary.unrotate(keys, prev)
        kc = self._key.coder.encode(project(k, self._key.projection))
        vc = self._value.coder.encode(project(values, self._value.projection))
        # both written before either is kept: a failure on the values leaves the keys as they were
        key_codes = write_rows(self._key_codes, kc, prev, self.step)
        value_codes = write_rows(self._value_codes, vc, prev, self.step)
        sinks = self._sinks.write(keys, values, prev)
        recent = self._recent.write(keys, values, prev)
        self._key_codes, self._value_codes = key_codes, value_codes
        self._sinks, self._recent = sinks, recent
        self._shape, self._dtype = (b, h, d, dv), keys.dtype
        self.offset = prev + keys.shape[2]
        return self._fetch()

    def _fetch(self) -> tuple[mx.array, mx.array]:
        n = self.offset
        kl = self._key.coder.decode(self._key_codes[..., :n, :])
        vl = self._value.coder.decode(self._value_codes[..., :n, :])
        if self.rotary is None:
            keys = reconstruct(kl, self._key.projection, self._dtype)
        else:
            keys = self.rotary.rotate(reconstruct(kl, self._key.projection, mx.float32), 0).astype(
                self._dtype
            )
        values = reconstruct(vl, self._value.projection, self._dtype)
        sinks, m = self._sinks, self._sinks.count(n)
        keys = self._recent.overlay(sinks.overlay(keys, sinks.keys, n), 0, n, m)
        values = self._recent.overlay(sinks.overlay(values, sinks.values, n), 1, n, m)
        return keys, values

    def latent_store(self) -> LatentStore | None:
        """The packed codes for :func:`~palu_mlx.attention.latent_attention`; None while empty."""
        if self._key_codes is None:
            return None
        key_codes, value_codes = self._key_codes, self._value_codes
        key, value = self._key.coder, self._value.coder
        m = self._sinks.count(self.offset)
        lo, hi = self._recent.span(self.offset, m)
        recent = self._recent.rows(lo, hi) if lo < hi else (None, None)
        return LatentStore(
            heads=self._shape[1],
            length=self.offset,
            key_latents=lambda start, stop: self._key.coder.decode(key_codes[..., start:stop, :]),
            key_projection=self._key.projection,
            rotary=self.rotary,
            value_latents=lambda start, stop: self._value.coder.decode(value_codes[..., start:stop, :]),
            value_projection=self._value.projection,
            exact_keys=self._sinks.keys[..., :m, :] if m else None,
            exact_values=self._sinks.values[..., :m, :] if m else None,
            recent_keys=recent[0],
            recent_values=recent[1],
            recent_start=lo if lo < hi else None,
            packed_keys=PackedRows(key_codes, key.widths, key.steps, key.token_scale),
            packed_values=PackedRows(value_codes, value.widths, value.steps, value.token_scale),
        )

    # ---------------------------------------------------------------- state
    @property
    def state(self) -> dict[str, mx.array]:
        """Codes cut to ``offset`` plus the calibration constants and RoPE frequencies (self-contained),
        and ``meta_state`` (the :attr:`meta_state` and a checksum, as in :attr:`PaluKVCache.state`).

        Copies: writing into them (or into numpy views of them) cannot change the cache.
        """
        return with_meta(type(self).__name__, self._state_arrays(), self.meta_state)

    def _state_arrays(self) -> dict[str, mx.array]:
        out = {f"key.{n}": a for n, a in self._key.arrays().items()}
        out.update({f"value.{n}": a for n, a in self._value.arrays().items()})
        if self.rotary is not None:
            out["rope.inv_freq"] = self.rotary.inv_freq
        if self._key_codes is not None:
            out["key.codes"] = self._key_codes[..., : self.offset, :]
            out["value.codes"] = self._value_codes[..., : self.offset, :]
        m = self._sinks.count(self.offset)
        if m:
            out["sink.keys"] = self._sinks.keys[..., :m, :]
            out["sink.values"] = self._sinks.values[..., :m, :]
        out.update(self._recent.state(self.offset)[0])
        return {k: detached(v) for k, v in out.items()}

    @property
    def meta_state(self) -> tuple[str, str]:
        runtime = {
            **self._runtime(),
            "key_widths": list(self._key.coder.widths),
            "value_widths": list(self._value.coder.widths),
            "rope": None if self.rotary is None else self.rotary.to_meta(),
        }
        if self.config.palu_recent_tokens:
            runtime["recent_start"] = self._recent.state(self.offset)[1]
        return self.config.to_json(), json.dumps(runtime, sort_keys=True)

    @classmethod
    def from_state(cls, state: dict[str, mx.array], meta_state=None) -> CalibratedKVCache:
        """Rebuild a cache from :attr:`state` and :attr:`meta_state` (None: the one the state carries).

        Every metadata field and every array is checked first (widths, offset, names, shapes,
        dtypes, finite values, positive steps): a mismatch raises ``KVDataError`` naming it.
        """
        owner = f"{cls.__name__}.from_state"
        state, meta_state = split_state(state, meta_state, cls.__name__, owner)
        settings, runtime = parse_meta_state(meta_state, owner)
        offset, shape, dtype = read_runtime(runtime, cls.__name__, owner)
        config = read_config(settings, owner)
        arrays = StateArrays(state, owner)
        taken = {}
        for prefix in ("key", "value"):
            widths = read_widths(read_field(runtime, f"{prefix}_widths", owner), f"{prefix}_widths", owner)
            name = f"{prefix}.basis"
            if name not in arrays or state[name].ndim != 3:
                got = tuple(state[name].shape) if name in arrays else "nothing"
                raise KVDataError(f"{owner}: state array {name!r} must be [H, D, r]; got {got}")
            h, d, _ = state[name].shape
            if shape is not None and (h, d) != (shape[1], shape[2] if prefix == "key" else shape[3]):
                raise KVDataError(
                    f"{owner}: state array {name!r} of shape {state[name].shape} does not match meta_state shape {list(shape)}"
                )
            r = len(widths)
            basis = arrays.take(name, (h, d, r), SUPPORTED_DTYPES)
            mean = arrays.take(f"{prefix}.mean", (h, d), SUPPORTED_DTYPES)
            steps = arrays.take(f"{prefix}.steps", (h, r), mx.float32, positive=True)
            # a weighted calibration's decoder; states of unweighted ones have none
            decoder = (
                arrays.take(f"{prefix}.decoder", (h, d, r), SUPPORTED_DTYPES)
                if f"{prefix}.decoder" in arrays
                else None
            )
            codes = None
            if shape is not None:
                row_bytes = FixedQuantCoder(
                    widths, mx.ones((1, len(widths))), config.palu_token_scale
                ).bytes_per_row
                codes = arrays.take(f"{prefix}.codes", (shape[0], h, offset, row_bytes), mx.uint8)
            taken[prefix] = (widths, basis, mean, steps, codes, decoder)
        key_heads, value_heads = taken["key"][1].shape[0], taken["value"][1].shape[0]
        if key_heads != value_heads:
            raise KVDataError(
                f"{owner}: key.basis has {key_heads} heads but value.basis {value_heads}; they must agree"
            )
        rope = read_rope(read_field(runtime, "rope", owner), taken["key"][1].shape[1], owner)
        inv_freq = None if rope is None else arrays.take("rope.inv_freq", (rope[0] // 2,), mx.float32)
        m = 0 if shape is None else min(config.palu_sink_tokens, offset)
        sink = (
            [
                arrays.take(f"sink.{p}", (shape[0], shape[1], m, w), dtype)
                for p, w in (("keys", shape[2]), ("values", shape[3]))
            ]
            if m
            else None
        )
        recent = (
            None
            if shape is None
            else read_recent(arrays, runtime, config.palu_recent_tokens, shape, offset, dtype, owner)
        )
        arrays.finish()
        tensor_codes = {}
        for prefix, (widths, basis, mean, steps, _, decoder) in taken.items():
            steps = detached(steps)
            proj = GroupProjection(
                basis=detached(basis),
                mean=detached(mean),
                singular_values=steps,
                decoder=None if decoder is None else detached(decoder),
            )
            tensor_codes[prefix] = _TensorCode(proj, FixedQuantCoder(widths, steps, config.palu_token_scale))
        rotary = None if rope is None else Rotary(detached(inv_freq), *rope)
        cache = cls(config, tensor_codes["key"], tensor_codes["value"], rotary)
        if shape is not None:
            cache._key_codes = write_rows(None, taken["key"][4], 0, cls.step)
            cache._value_codes = write_rows(None, taken["value"][4], 0, cls.step)
            cache._shape, cache._dtype, cache.offset = shape, dtype, offset
            if sink is not None:
                cache._sinks = cache._sinks.write(detached(sink[0]), detached(sink[1]), 0)
            cache._recent = recent
        return cache

    # ---------------------------------------------------------------- measured storage
    def held_arrays(self) -> list[mx.array]:
        """The per-sequence arrays: packed key and value codes (at their grown capacity) and the
        exact first tokens (``palu_sink_tokens``)."""
        held = [a for a in (self._key_codes, self._value_codes) if a is not None]
        return held + self._sinks.arrays() + self._recent.arrays()

    @property
    def nbytes(self) -> int:
        """Bytes of the packed codes held (calibration constants are per model: ``constant_nbytes``)."""
        return sum(a.nbytes for a in self.held_arrays())

    @property
    def constant_nbytes(self) -> int:
        """Bytes of this layer's calibration constants (bases, means, steps), shared by every sequence."""
        return sum(a.nbytes for t in (self._key, self._value) for a in t.arrays().values())

    @property
    def key_rank(self) -> int:
        return self._key.coder.rank

    @property
    def value_rank(self) -> int:
        return self._value.coder.rank

    @property
    def fitted(self) -> bool:
        return True

    def __repr__(self) -> str:
        rope = ", pre-RoPE keys" if self.rotary is not None else ""
        return (
            f"CalibratedKVCache(offset={self.offset}, r_k={self.key_rank} ({self._key.coder.bits_per_row} bits), "
            f"r_v={self.value_rank} ({self._value.coder.bits_per_row} bits){rope})"
        )


def calibrated_caches(
    config: KVCacheConfig,
    calibration: Calibration,
    rotaries: list[Rotary | None] | None,
    heads: slice | None = None,
) -> list[CalibratedKVCache | None]:
    """One :class:`CalibratedKVCache` per calibrated layer (None elsewhere) at ``config.palu_bits``.

    ``rotaries`` must be given (one per layer) when the calibration was made on pre-RoPE keys.
    ``heads`` (tensor parallel: this rank's KV heads of a whole-model file): the widths come from
    the whole file's water-filling level, and each cache holds only these heads' projections and
    steps, so every rank codes its heads as one process does.
    """
    if calibration.pre_rope and not rotaries:
        raise KVConfigError(
            "palu_calibration was fitted on pre-RoPE keys, but this model gets no pre-RoPE path "
            "(palu_pre_rope=False or an unsupported architecture)"
        )
    bits = config.coder_bits if config.coder_bits is not None else DEFAULT_PALU_BITS
    out: list[CalibratedKVCache | None] = []
    for i, widths in enumerate(allocate_widths(calibration, bits)):
        if widths is None:
            out.append(None)
            continue
        key = _tensor_code(_heads(calibration.keys[i], heads), widths[0], config.palu_token_scale)
        value = _tensor_code(_heads(calibration.values[i], heads), widths[1], config.palu_token_scale)
        rotary = rotaries[i] if calibration.pre_rope else None
        out.append(CalibratedKVCache(config, key, value, rotary))
    return out


def _heads(t: TensorCalibration, heads: slice | None) -> TensorCalibration:
    """``t`` cut to the KV heads ``heads`` (all when None)."""
    if heads is None:
        return t
    if heads.stop > t.basis.shape[0]:
        raise KVConfigError(
            f"heads {heads.start}:{heads.stop} exceed the calibration's {t.basis.shape[0]} KV heads"
        )
    cut = {name: mx.contiguous(arr[heads]) for name, arr in t.arrays().items()}
    return TensorCalibration(**cut)
