"""A code with nothing to fit: a fixed rotation of each head's channels and uniform bits per channel.

A fitted projection costs ``H x D x r`` numbers per tensor and layer, whatever the sequence length:
against a sliding-window layer's ``W`` rows of ``H x D`` that is ``r / W`` of its 16-bit bytes at
16 bits a number, half of them for a window of 128 and heads of 64. Such a layer would keep more
than mlx-lm's 16-bit ``RotatingKVCache``. This code keeps nothing per sequence or layer but its
codes and each head's mean (below): each head's keys and values are rotated by one orthonormal matrix (a Hadamard matrix for a
power-of-two head dim, which spreads an outlier channel over every channel, so that one scale per
token and head fits them all), then every rotated channel is quantized in :data:`ROTATION_BITS`
bits under a per-token scale (:class:`~palu_mlx.coders.fixed.FixedQuantCoder`). The rotation and
the quantizer steps are built once per (heads, head dim) and shared by every layer and by keys and
values, so they are held once, in bfloat16.

Pre-RoPE keys keep a per-channel offset that a rotation spreads into every rotated channel, where
a per-token scale must cover it: :class:`RotationKVCache` subtracts each head's mean key and value,
taken over the first update (the prefill), before rotating, its one per-sequence number per head
and channel. On SmolLM2 that mean cuts the code's KL to about a third at the same bytes
(``benchmarks/results/palu_rotation_code.json``). It codes as a
:class:`~palu_mlx.calibrated.CalibratedKVCache` does (a fixed code from the first token), so its
states save and load as calibrated ones do, the means among their arrays.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError, KVDataError, KVShapeError

from .calibrated import CalibratedKVCache
from .coders.fixed import GAUSSIAN_STEP, FixedQuantCoder
from .coders.rotation import Rotation
from .config import KVCacheConfig
from .lowrank import GroupProjection
from .mixed_bit import BitAllocationPolicy
from .projection_source import CalibratedTensor, FromCalibration, SavedState, StateRead, read_rotary
from .rope import Rotary
from .state_checks import read_field

__all__ = [
    "ROTATION_BITS",
    "FIT_WINDOW_PER_DIM",
    "fits_window",
    "window_config",
    "orthonormal_rotation",
    "rotation_code",
    "rotation_cache",
    "RotationKVCache",
    "RotationSource",
    "rotation_bits",
]

#: bits per rotated channel: on SmolLM2 (every layer, 1,024 + 128 tokens) 4 bits keep 0.087x the
#: KL of mlx-lm's 4-bit cache at 1.05x its bytes (``benchmarks/results/palu_rotation_code.json``)
ROTATION_BITS = 4
#: a window of at least this many tokens per head dim pays for a fitted projection: one of full
#: rank is then at most a sixteenth of the window's 16-bit rows
FIT_WINDOW_PER_DIM = 16
#: a window's exact newest tokens are at most this fraction of it
RECENT_SHARE = 16
#: seed of the random orthonormal matrix used where the head dim is not a power of two
_SEED = 0


def fits_window(window: int, head_dim: int) -> bool:
    """Whether a sliding window of ``window`` tokens is long enough to fit projections for."""
    return window >= FIT_WINDOW_PER_DIM * head_dim


def window_config(config: KVCacheConfig, window: int, keep: int) -> KVCacheConfig:
    """``config`` for a window of ``window`` tokens keeping its first ``keep``: as many exact first
    tokens as the window keeps (the others leave it), at most ``window // RECENT_SHARE`` exact
    newest ones."""
    return dataclasses.replace(
        config,
        palu_sink_tokens=min(config.palu_sink_tokens, keep),
        palu_recent_tokens=min(config.palu_recent_tokens, window // RECENT_SHARE),
    )


def orthonormal_rotation(dim: int) -> np.ndarray:
    """``[dim, dim]`` float32 orthonormal: the Sylvester Hadamard matrix over ``sqrt(dim)`` for a
    power of two, else a seeded random orthonormal matrix (QR of a Gaussian matrix)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise KVConfigError(f"dim={dim!r} must be a positive integer")
    if dim & (dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < dim:
            h = np.block([[h, h], [h, -h]])
        return (h / np.sqrt(dim)).astype(np.float32)
    q, r = np.linalg.qr(np.random.default_rng(_SEED).standard_normal((dim, dim)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def rotation_code(heads: int, dim: int, bits: int = ROTATION_BITS) -> CalibratedTensor:
    """The code of one ``[B, heads, S, dim]`` tensor: the rotation for every head, no mean, and
    ``bits`` per channel under a per-token scale. One object per (heads, dim, bits), shared."""
    return _rotation_code(heads, dim, bits)


@lru_cache(maxsize=16)
def _rotation_code(heads: int, dim: int, bits: int) -> CalibratedTensor:
    if bits not in GAUSSIAN_STEP:
        raise KVConfigError(f"bits={bits!r} must be one of {sorted(GAUSSIAN_STEP)}")
    rotation = mx.array(np.broadcast_to(orthonormal_rotation(dim), (heads, dim, dim)).copy())
    steps = mx.full((heads, dim), GAUSSIAN_STEP[bits], dtype=mx.float32)
    # held in bfloat16 (upcast at use): a Hadamard matrix's entries are exact there for head dims
    # of 4^k (64, 256) and within 2^-9 otherwise, far below a 4-bit step
    projection = GroupProjection(
        basis=rotation, mean=mx.zeros((heads, dim), dtype=mx.float32), singular_values=steps
    ).astype(mx.bfloat16)
    return CalibratedTensor(projection, FixedQuantCoder((bits,) * dim, steps, token_scale=True))


class RotationSource(FromCalibration):
    """:class:`~palu_mlx.projection_source.FromCalibration` on rotation codes, which it builds from
    the first keys' shape when not given them: a cache made before the model's head count is
    known (a tier from the registry, the conformance suite) codes as one made for the model."""

    def __init__(
        self,
        key: CalibratedTensor | None = None,
        value: CalibratedTensor | None = None,
        bits: tuple[int, int] = (ROTATION_BITS, ROTATION_BITS),
    ):
        if key is None and value is None:
            self.key = self.value = None
        else:
            super().__init__(key, value)
        self.bits = bits

    def built(self, heads: int, key_dim: int, value_dim: int) -> RotationSource:
        """This source with its codes (itself once it has them)."""
        if self.key is not None:
            return self
        return RotationSource(
            rotation_code(heads, key_dim, self.bits[0]),
            rotation_code(heads, value_dim, self.bits[1]),
            self.bits,
        )

    def initial(self):
        return None if self.key is None else super().initial()

    def check_dims(self, h: int, d: int, dv: int, rotary: Rotary | None) -> None:
        if self.key is not None:
            super().check_dims(h, d, dv, rotary)
        elif rotary is not None and rotary.dims > d:  # codes not built yet: only the RoPE to check
            raise KVShapeError(f"keys head dim {d} is smaller than the RoPE dims {rotary.dims}")

    def saved_arrays(self, projection, coder) -> dict[str, mx.array]:
        return {} if projection is None else super().saved_arrays(projection, coder)

    def meta(self, key_coder, value_coder) -> dict[str, Any]:
        if key_coder is None:  # nothing held yet: the bits say what the codes will be
            return {"key_widths": None, "value_widths": None, "rotation_bits": list(self.bits)}
        return super().meta(key_coder, value_coder)

    @classmethod
    def read_state(cls, saved: SavedState, allocation_policy: BitAllocationPolicy | None = None) -> StateRead:
        config, runtime, arrays, shape, _, owner = saved
        if shape is not None or read_field(runtime, "key_widths", owner) is not None:
            return super().read_state(saved, allocation_policy)
        bits = read_field(runtime, "rotation_bits", owner)
        if (
            not isinstance(bits, list)
            or len(bits) != 2
            or any(isinstance(b, bool) or b not in GAUSSIAN_STEP for b in bits)
        ):
            raise KVDataError(f"{owner}: meta_state rotation_bits={bits!r} must be two ints in 1..8")
        rotary = read_rotary(arrays, read_field(runtime, "rope", owner), None, owner)
        return StateRead(cls(bits=(bits[0], bits[1])), rotary, None)


class RotationKVCache(CalibratedKVCache):
    """A :class:`~palu_mlx.calibrated.CalibratedKVCache` on :func:`rotation_code` whose projections
    subtract each head's mean key and value over the first update, fitted then (a state already
    holding tokens keeps its own). Its config's ``method`` is ``"palu"`` (a short window of a palu
    config) or ``"rotation"``.

    Args:
        config: the config (exact tokens, per-token scale; :func:`rotation_bits` when no codes given).
        key, value: the layer's rotation codes (:func:`rotation_code`); None: built at the first
            update from its head count and dims, at :func:`rotation_bits` of ``config``.
        rotary: the layer's RoPE, for keys before it.
    """

    _source_type = RotationSource

    def __init__(
        self,
        config: KVCacheConfig,
        key: CalibratedTensor | None = None,
        value: CalibratedTensor | None = None,
        rotary: Rotary | None = None,
    ):
        self._check_config(config)
        if (key is None) != (value is None):
            raise KVConfigError(
                "key and value must both be rotation codes or both be None (built at the first update)"
            )
        self._setup(config, RotationSource(key, value, rotation_bits(config)), rotary)

    @staticmethod
    def _check_config(config: KVCacheConfig) -> None:
        if not isinstance(config, KVCacheConfig):
            raise KVConfigError(f"config must be a KVCacheConfig; got {type(config).__name__}")
        if config.method not in ("palu", "rotation"):
            raise KVConfigError(f"RotationKVCache needs method 'palu' or 'rotation'; got {config.method!r}")

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.offset == 0:
            _, h, _, d, dv = self._validate(keys, values, self.config.palu_check_finite)  # before any fit
            saved = (self.source, self._key_proj, self._key_coder, self._value_proj, self._value_coder)
            self.source = self.source.built(h, d, dv)
            (key_proj, self._key_coder), (value_proj, self._value_coder) = self.source.initial()
            self._key_proj = _centred(key_proj, self._pre_rope(keys, 0))
            self._value_proj = _centred(value_proj, values)
            try:
                return super().update_and_fetch(keys, values)
            except Exception:
                self.source, self._key_proj, self._key_coder, self._value_proj, self._value_coder = saved
                raise
        return super().update_and_fetch(keys, values)

    def _held(self, which: str) -> list[mx.array]:
        # the means are this sequence's (the rotation and steps are the model's)
        proj = self._key_proj if which == "key" else self._value_proj
        own = [proj.mean] if self.offset and proj is not None else []
        return super()._held(which) + own


def _centred(projection: GroupProjection, x: mx.array) -> GroupProjection:
    """``projection`` with the mean of ``x [B, H, S, D]`` over batch and tokens, per head."""
    mean = mx.mean(x.astype(mx.float32), axis=(0, 2)).astype(projection.mean.dtype)
    return GroupProjection(basis=projection.basis, mean=mean, singular_values=projection.singular_values)


def rotation_bits(config: KVCacheConfig) -> tuple[int, int]:
    """Bits per rotated channel of keys and of values: ``palu_bits`` of a ``method="rotation"``
    config (a half, 3.5, gives keys 4 and values 3), else :data:`ROTATION_BITS` for both (a palu
    config's bit budget is spent on fitted channels, not these)."""
    if isinstance(config.coder, Rotation):
        return config.coder.key_bits, config.coder.value_bits
    return ROTATION_BITS, ROTATION_BITS


def rotation_cache(
    config: KVCacheConfig,
    heads: int | None = None,
    key_dim: int | None = None,
    value_dim: int | None = None,
    rotary: Rotary | None = None,
) -> RotationKVCache:
    """A layer cache coding with :func:`rotation_code` at :func:`rotation_bits`: ``config`` with its
    per-token scale on (the steps are relative to it) and its exact tokens as given. ``heads`` or a
    dim None: the codes are built at the first update from its shape (what a model's own layers
    give, whatever its args say)."""
    key_bits, value_bits = rotation_bits(config)
    config = config.replace(palu_token_scale=True, palu_calibration=None)
    if heads is None or key_dim is None or value_dim is None:
        return RotationKVCache(config, rotary=rotary)
    return RotationKVCache(
        config, rotation_code(heads, key_dim, key_bits), rotation_code(heads, value_dim, value_bits), rotary
    )
