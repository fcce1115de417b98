"""Seeded generators for the synthetic test-vector families, and the script that writes them.

Every generator takes a shape ``(B, H, S, D)`` and a seed, and returns float32 ``keys``
``[B, H, S, D]`` and ``values`` ``[B, H, S, D]`` (numpy only, ``np.random.default_rng``).
:data:`SYNTHETIC_SPECS` lists the shipped vectors;

    python -m kvspec.synthetic            # rewrite the synthetic part of kvspec/data
    python -m kvspec.synthetic --check    # exit 1 if the shipped data differs from a regeneration

keeps any ``"real"`` vectors already in the data directory.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .interface import KVShapeError
from .vectors import DATA_DIR, TestVector, load_vectors, round_to_dtype, write_vectors

__all__ = [
    "planted_lowrank",
    "random_walk",
    "gaussian",
    "outlier_keys",
    "GENERATORS",
    "SyntheticSpec",
    "SYNTHETIC_SPECS",
    "make_vector",
    "generate_synthetic",
    "main",
]

Shape = tuple[int, int, int, int]


def _check_shape(shape: object) -> Shape:
    """``shape`` as a ``(B, H, S, D)`` tuple of positive ints; ``KVShapeError`` otherwise.

    Every generator makes ``[B, H, S, D]`` tensors; another rank would come back as arrays no
    cache accepts (or fail deep inside numpy), so it is refused where the caller can see why.
    """
    ok = isinstance(shape, (tuple, list)) and len(shape) == 4
    ok = ok and all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 for n in shape)
    if not ok:
        raise KVShapeError(f"shape must be (B, H, S, D): four integers >= 1; got {shape!r}")
    return tuple(int(n) for n in shape)  # type: ignore[return-value]


def _orthonormal(rng: np.random.Generator, d: int, r: int) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((d, r)))
    return q  # [d, r], orthonormal columns


def _lowrank_tensor(rng: np.random.Generator, shape: Shape, rank: int, noise: float, scale: float):
    b, h, s, d = shape
    basis = _orthonormal(rng, d, rank)  # shared by every head, so a grouped SVD also sees rank r
    mean = rng.standard_normal(d) * 0.5 * scale
    # decaying singular values, as in real K/V spectra
    strengths = np.geomspace(3.0, 0.5, rank) * scale
    latents = rng.standard_normal((b, h, s, rank)) * strengths
    x = latents @ basis.T + mean + noise * scale * rng.standard_normal((b, h, s, d))
    return x


def planted_lowrank(shape: Shape, seed: int, rank: int = 8, noise: float = 0.05):
    """Rank-``rank`` keys and values plus i.i.d. noise.

    Each tensor is ``z @ U.T + mu + noise * eps`` with ``U`` a ``[D, rank]`` orthonormal basis
    shared by all heads, singular strengths from 3.0 down to 0.5, a per-channel mean ``mu`` and
    ``eps ~ N(0, 1)``. Values use their own basis at half the scale. Returns float64 arrays.
    """
    shape = _check_shape(shape)
    if not 1 <= rank <= shape[3]:
        raise ValueError(f"rank must be in [1, D={shape[3]}]; got {rank}")
    rng = np.random.default_rng(seed)
    keys = _lowrank_tensor(rng, shape, rank, noise, 1.0)
    values = _lowrank_tensor(rng, shape, rank, noise, 0.5)
    return keys, values


def _ar1(rng: np.random.Generator, shape: Shape, rho: float) -> np.ndarray:
    b, h, s, d = shape
    scale = np.exp(0.3 * rng.standard_normal(d))  # channels differ in scale, as in real K/V
    mean = 0.5 * rng.standard_normal(d)
    innovations = rng.standard_normal((b, h, s, d))
    x = np.empty((b, h, s, d))
    x[:, :, 0] = innovations[:, :, 0]
    step = np.sqrt(1.0 - rho * rho)
    for t in range(1, s):
        x[:, :, t] = rho * x[:, :, t - 1] + step * innovations[:, :, t]
    return x * scale + mean


def random_walk(shape: Shape, seed: int, rho: float = 0.98):
    """Autocorrelated along the sequence: a damped random walk (AR(1)) per channel.

    ``x[t] = rho * x[t-1] + sqrt(1 - rho^2) * eps[t]``, unit stationary variance, then a
    per-channel scale and mean. Keys use ``rho``, values ``rho - 0.03``. Smooth along S, so
    sequence-axis transforms (DCT) have something to exploit. Returns float64 arrays.
    """
    shape = _check_shape(shape)
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"rho must be in [0, 1); got {rho}")
    rng = np.random.default_rng(seed)
    keys = _ar1(rng, shape, rho)
    values = _ar1(rng, shape, max(0.0, rho - 0.03))
    return keys, values


def gaussian(shape: Shape, seed: int):
    """i.i.d. standard normal keys and values: no structure for any codec to exploit."""
    shape = _check_shape(shape)
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal(shape)


def outlier_keys(shape: Shape, seed: int, n_outliers: int = 4, magnitude: float = 12.0):
    """Keys with a few heavy channels per head, as real LLM keys have; plain Gaussian values.

    Each head gets ``n_outliers`` channels with a fixed-sign mean of ``magnitude`` times a
    U(0.7, 1.3) factor and a standard deviation of ``magnitude / 4``; other channels are N(0, 1).
    Returns float64 arrays.
    """
    shape = _check_shape(shape)
    b, h, s, d = shape
    if not 0 <= n_outliers <= d:
        raise ValueError(f"n_outliers must be in [0, D={d}]; got {n_outliers}")
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal(shape)
    for head in range(h):
        channels = rng.choice(d, size=n_outliers, replace=False)
        signs = rng.choice(np.array([-1.0, 1.0]), size=n_outliers)
        means = signs * magnitude * rng.uniform(0.7, 1.3, size=n_outliers)
        keys[:, head, :, channels] = means[:, None, None] + (magnitude / 4.0) * rng.standard_normal(
            (n_outliers, b, s)
        )
    values = rng.standard_normal(shape)
    return keys, values


GENERATORS: dict[str, Callable[..., tuple[np.ndarray, np.ndarray]]] = {
    "planted_lowrank": planted_lowrank,
    "random_walk": random_walk,
    "gaussian": gaussian,
    "outlier_keys": outlier_keys,
}


@dataclass(frozen=True)
class SyntheticSpec:
    """One shipped synthetic vector: which generator, with which shape, seed and parameters."""

    name: str
    family: str
    dtype: str
    shape: Shape
    generator: str
    seed: int
    params: dict[str, Any] = field(default_factory=dict)


def _spec(name, family, dtype, shape, generator, seed, **params) -> SyntheticSpec:
    return SyntheticSpec(name, family, dtype, shape, generator, seed, params)


#: the dtypes of a family's three vectors, in order, and the tags their names end in
_DTYPES = (("float32", "f32"), ("float16", "f16"), ("bfloat16", "bf16"))


def _family(prefix: str, generator: str, first_seed: int, shapes: tuple[Shape, Shape, Shape], **params):
    """One family's vectors, one per dtype of :data:`_DTYPES` (its shape and the next seed each)."""
    return tuple(
        _spec(f"{prefix}_{tag}", generator, dtype, shape, generator, first_seed + i, **params)
        for i, ((dtype, tag), shape) in enumerate(zip(_DTYPES, shapes, strict=True))
    )


#: the shipped synthetic vectors; edge vectors reuse the planted low-rank generator so their
#: tolerance means the same thing as for that family, only at awkward sizes
SYNTHETIC_SPECS: tuple[SyntheticSpec, ...] = (
    *_family(
        "lowrank_r8", "planted_lowrank", 1001, ((1, 2, 256, 64), (1, 4, 128, 64), (1, 2, 128, 64)), rank=8
    ),
    *_family("randwalk", "random_walk", 2001, ((1, 2, 256, 64), (1, 2, 128, 64), (1, 4, 128, 64)), rho=0.98),
    *_family("gaussian", "gaussian", 3001, ((1, 2, 128, 64),) * 3),
    *_family(
        "outlier", "outlier_keys", 4001, ((1, 4, 128, 64), (1, 2, 256, 64), (1, 2, 128, 64)), n_outliers=4
    ),
    _spec("edge_s1_f32", "edge", "float32", (1, 2, 1, 64), "planted_lowrank", 5001, rank=8),
    _spec("edge_s2_bf16", "edge", "bfloat16", (1, 4, 2, 64), "planted_lowrank", 5002, rank=8),
    _spec("edge_s37_f16", "edge", "float16", (1, 2, 37, 64), "planted_lowrank", 5003, rank=8),
    _spec("edge_h1_s131_f32", "edge", "float32", (1, 1, 131, 64), "planted_lowrank", 5004, rank=8),
    _spec("edge_b2_s77_bf16", "edge", "bfloat16", (2, 2, 77, 64), "planted_lowrank", 5005, rank=8),
    _spec("edge_d128_s65_f16", "edge", "float16", (1, 2, 65, 128), "planted_lowrank", 5006, rank=8),
)


def make_vector(spec: SyntheticSpec) -> TestVector:
    """Generate one vector from its spec, rounded to its dtype (float32 arrays)."""
    keys, values = GENERATORS[spec.generator](spec.shape, spec.seed, **spec.params)
    return TestVector(
        name=spec.name,
        family=spec.family,
        dtype=spec.dtype,
        keys=round_to_dtype(keys.astype(np.float32), spec.dtype),
        values=round_to_dtype(values.astype(np.float32), spec.dtype),
        provenance={
            "generator": f"kvspec.synthetic.{spec.generator}",
            "seed": spec.seed,
            "params": dict(spec.params),
            "rng": "numpy.random.default_rng (PCG64)",
            "rounding": f"float64 -> float32 -> {spec.dtype} round-to-nearest-even",
        },
    )


def generate_synthetic(specs: tuple[SyntheticSpec, ...] = SYNTHETIC_SPECS) -> list[TestVector]:
    """Every synthetic vector, freshly generated (deterministic for a given numpy)."""
    return [make_vector(spec) for spec in specs]


def _same(a: TestVector, b: TestVector) -> bool:
    return (
        a.name == b.name
        and a.family == b.family
        and a.dtype == b.dtype
        and a.provenance == b.provenance
        and np.array_equal(a.keys, b.keys)
        and np.array_equal(a.values, b.values)
    )


def main(argv: list[str] | None = None) -> int:
    """Regenerate (or ``--check``) the synthetic vectors in ``--data-dir``; keep ``"real"`` ones."""
    parser = argparse.ArgumentParser(prog="python -m kvspec.synthetic", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR, help="default: the kvspec package data")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when the data differs")
    args = parser.parse_args(argv)

    existing = load_vectors(data_dir=args.data_dir) if (args.data_dir / "manifest.json").exists() else []
    fresh = generate_synthetic()
    if args.check:
        old = {v.name: v for v in existing if v.family != "real"}
        differing = [v.name for v in fresh if v.name not in old or not _same(v, old[v.name])]
        stale = sorted(set(old) - {v.name for v in fresh})
        if differing or stale:
            print(f"synthetic vectors differ from a regeneration: changed {differing}, stale {stale}")
            return 1
        print(f"{len(fresh)} synthetic vectors match a regeneration")
        return 0
    real = [v for v in existing if v.family == "real"]
    write_vectors(fresh + real, args.data_dir)
    size = sum(p.stat().st_size for p in Path(args.data_dir).iterdir() if p.is_file())
    print(f"wrote {len(fresh)} synthetic + kept {len(real)} real vectors to {args.data_dir} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
