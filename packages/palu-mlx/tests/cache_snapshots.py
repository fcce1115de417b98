"""Helpers of the bad-input, copy and property tests: one small cache of every kind and phase, and an
exact snapshot of a cache to prove that a call changed nothing.

Shapes are small (B=1, H=2, D=Dv=32) so that hypothesis can run many sequences quickly.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from palu_mlx import KVCacheConfig, NaiveQuantKVCache, PaluKVCache
from palu_mlx.calibrated import calibrated_caches
from palu_mlx.calibration import Calibration, TensorCalibration
from palu_mlx.config import REFERENCE_SPLIT
from palu_mlx.rope import Rotary

B, H, D = 1, 2, 32


def kv(tokens: int, seed: int, dtype=mx.float32, scale: float = 1.0) -> tuple[mx.array, mx.array]:
    """Seeded keys and values ``[B, H, tokens, D]``."""
    k1, k2 = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((B, H, tokens, D), key=k1) * scale
    values = mx.random.normal((B, H, tokens, D), key=k2) * scale
    return keys.astype(dtype), values.astype(dtype)


def rotary() -> Rotary:
    return Rotary(mx.array((10000.0 ** -(np.arange(D // 2) * 2 / D)).astype(np.float32)), D, False)


def synthetic_calibration(n_layers: int = 1) -> Calibration:
    """A calibration of orthonormal per-head bases (no model needed): enough to build caches."""
    rng = np.random.default_rng(0)

    def tensor() -> TensorCalibration:
        basis = np.stack([np.linalg.qr(rng.normal(size=(D, D)))[0] for _ in range(H)]).astype(np.float32)
        variance = np.sort(rng.uniform(0.1, 2.0, size=(H, D)), axis=1)[:, ::-1].astype(np.float32)
        return TensorCalibration(mx.array(basis), mx.array(np.zeros((H, D), np.float32)), mx.array(variance))

    identity = {"architecture": "synthetic", "n_layers": n_layers, "n_kv_heads": H, "head_dim": D}
    return Calibration(
        identity,
        [tensor() for _ in range(n_layers)],
        [tensor() for _ in range(n_layers)],
        False,
        0,
        "",
    )


def palu(**kw) -> PaluKVCache:
    kw.setdefault("head_dim", D)
    kw.setdefault("palu_n_head_groups", 1)
    kw.setdefault("palu_min_fit_tokens", 8)
    return PaluKVCache(KVCacheConfig(**kw))


def calibrated(bits: float = 2.0):
    return calibrated_caches(KVCacheConfig(head_dim=D, palu_bits=bits), synthetic_calibration(), None)[0]


#: name -> (constructor, tokens to feed it): every cache class in each of its phases
KINDS = {
    "palu-empty": (lambda: palu(), 0),
    "palu-exact": (lambda: palu(), 5),
    "palu-fitted": (lambda: palu(palu_rank=8), 12),
    "palu-fitted-unquantized": (lambda: palu(palu_hi_bit=16, palu_lo_bit=16), 12),
    "palu-fixed": (lambda: palu(palu_bits=2.0), 12),
    "palu-pre-rope": (
        lambda: PaluKVCache(
            # the reference's split: 16-bit per-token scales (the fixed coder is "palu-fixed")
            KVCacheConfig(head_dim=D, palu_n_head_groups=1, palu_min_fit_tokens=8, **REFERENCE_SPLIT),
            rotary=rotary(),
        ),
        12,
    ),
    "naive-empty": (lambda: NaiveQuantKVCache(2, 32), 0),
    "naive": (lambda: NaiveQuantKVCache(2, 32), 7),
    "calibrated-empty": (calibrated, 0),
    "calibrated": (calibrated, 7),
}


def build(kind: str, dtype=mx.float32):
    """A cache of ``kind`` (see :data:`KINDS`) fed its tokens."""
    make, tokens = KINDS[kind]
    cache = make()
    if tokens:
        cache.update_and_fetch(*kv(tokens, 1, dtype))
    return cache


def array_bytes(a: mx.array) -> tuple[str, tuple[int, ...], bytes]:
    a = mx.contiguous(a)
    return str(a.dtype), tuple(a.shape), bytes(memoryview(a)) if a.size else b""


def snapshot(cache) -> tuple:
    """Everything observable about a cache, exactly: offset, meta_state, every state array's
    bytes, nbytes, and the bytes of what it returns next for one fixed token (on a deep copy,
    so taking the snapshot changes nothing)."""
    import copy

    state = {k: array_bytes(v) for k, v in cache.state.items()}
    probe = copy.deepcopy(cache)
    try:
        out = tuple(array_bytes(x) for x in probe.update_and_fetch(*kv(1, 99, cache._dtype or mx.float32)))
    except Exception as exc:  # noqa: BLE001 - an empty cache of another dtype etc.: record what it says
        out = (type(exc).__name__,)
    return cache.offset, cache.meta_state, state, cache.nbytes, out
