"""A code with nothing to fit: a fixed rotation of each head's channels and uniform bits per channel.

A fitted projection costs ``H x D x r`` numbers per tensor and layer, whatever the sequence length:
against a sliding-window layer's ``W`` rows of ``H x D`` that is ``r / W`` of its 16-bit bytes at
16 bits a number, half of them for a window of 128 and heads of 64. Such a layer would keep more
than mlx-lm's 16-bit ``RotatingKVCache``. This code keeps nothing per sequence or layer but its
codes: each head's keys and values are rotated by one orthonormal matrix (a Hadamard matrix for a
power-of-two head dim, which spreads an outlier channel over every channel, so that one scale per
token and head fits them all), then every rotated channel is quantized in :data:`ROTATION_BITS`
bits under a per-token scale (:class:`~palu_mlx.coders.fixed.FixedQuantCoder`). The rotation and
the quantizer steps are built once per (heads, head dim) and shared by every layer and by keys and
values, so they are held once, in bfloat16.

It runs as a :class:`~palu_mlx.calibrated.CalibratedKVCache` (a fixed code from the first token),
so its states save and load as calibrated ones do.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError

from .calibrated import CalibratedKVCache
from .coders.fixed import GAUSSIAN_STEP, FixedQuantCoder
from .config import KVCacheConfig
from .lowrank import GroupProjection
from .projection_source import CalibratedTensor
from .rope import Rotary

__all__ = [
    "ROTATION_BITS",
    "FIT_WINDOW_PER_DIM",
    "fits_window",
    "window_config",
    "orthonormal_rotation",
    "rotation_code",
    "rotation_cache",
]

#: bits per rotated channel: on SmolLM2 (every layer, 1,024 + 128 tokens) 4 bits keep 0.24x the
#: KL of mlx-lm's 4-bit cache at 1.04x its bytes, where 3 bits have 1.5x its KL
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


@lru_cache(maxsize=16)
def rotation_code(heads: int, dim: int, bits: int = ROTATION_BITS) -> CalibratedTensor:
    """The code of one ``[B, heads, S, dim]`` tensor: the rotation for every head, no mean, and
    ``bits`` per channel under a per-token scale. One object per (heads, dim, bits), shared."""
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


def rotation_cache(
    config: KVCacheConfig, heads: int, key_dim: int, value_dim: int, rotary: Rotary | None
) -> CalibratedKVCache:
    """A layer cache coding with :func:`rotation_code`: ``config`` with its per-token scale on (the
    steps are relative to it) and its exact tokens as given."""
    config = dataclasses.replace(config, palu_token_scale=True, palu_calibration=None)
    return CalibratedKVCache(config, rotation_code(heads, key_dim), rotation_code(heads, value_dim), rotary)
