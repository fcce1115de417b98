"""Framework-neutral conformance checks: plain functions over an :class:`~kvspec.adapter.Adapter`.

Each check is ``check_<name>(adapter, case, vector=None)``. It builds caches with
``adapter.make(case.config)``, feeds them numpy test vectors through ``adapter.to_native``,
reads results back through ``adapter.to_numpy``, and raises :class:`ConformanceError` (an
``AssertionError``) with a precise message on the first violation. It returns
:data:`PASSED`, or :data:`NOT_APPLICABLE` when the case lacks the capability the check is
about (or the vector's dtype is not one the adapter accepts). Each is written as the check alone,
registered with ``@_check(name, per_vector, applies)``, which adds those two answers.

:data:`CHECKS` registers every check with whether it runs once per test vector or once per
configuration; :func:`conformance_items` expands an adapter into the applicable
``(case, vector, check)`` items with readable ids (``<adapter>-<case>-<vector>-<check>``),
which is what ``shared-tests/conformance`` parametrizes over. From a shell::

    python -m kvspec.conformance kvspec.reference:ReferenceAdapter
"""

from __future__ import annotations

import argparse
import functools
import importlib
import numbers
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .adapter import Adapter, CacheConfigCase, Capabilities
from .interface import KVCacheLayer, KVConfigError, KVDtypeError, KVShapeError, KVTrimError, KVValueError
from .synthetic import planted_lowrank
from .vectors import TestVector, load_vectors, round_to_dtype

__all__ = [
    "ConformanceError",
    "PASSED",
    "NOT_APPLICABLE",
    "Check",
    "CHECKS",
    "CheckItem",
    "conformance_items",
    "run_conformance",
    "stream_schedule",
    "relative_error",
    "check_protocol",
    "check_shape_dtype",
    "check_offset_accounting",
    "check_causal_stability",
    "check_lossless",
    "check_reconstruction_error",
    "check_byte_honesty",
    "check_determinism",
    "check_trim",
    "check_serialization",
    "check_bad_input",
    "check_rejects_nonfinite",
    "check_compresses",
]

PASSED = "passed"
NOT_APPLICABLE = "not applicable"

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# machine epsilon and smallest subnormal of each dtype: "within float rounding of the input dtype"
_EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
_TINY = {"float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}


class ConformanceError(AssertionError):
    """A cache broke the kvspec contract; the message says where and how."""


# =========================================================================== helpers
def _where(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None, extra: str = "") -> str:
    parts = [adapter.name, case.name] + ([vector.name] if vector is not None else [])
    return f"[{'/'.join(parts)}{' ' + extra if extra else ''}]"


def _fail(where: str, message: str) -> None:
    raise ConformanceError(f"{where} {message}")


def stream_schedule(s: int, singles: int = 16, cycle: tuple[int, ...] = (3, 17, 8, 31)) -> list[int]:
    """How a vector of ``s`` tokens is fed: a prefill of ``s // 2``, up to ``singles``
    one-token steps, then multi-token appends cycling through ``cycle``. Sums to ``s``.

    ``KVConfigError`` unless ``s >= 1``, ``singles >= 0`` and ``cycle`` is a non-empty sequence of
    positive ints (a zero in ``cycle`` would never finish).
    """

    def is_int(x: Any, low: int) -> bool:
        return not isinstance(x, bool) and isinstance(x, numbers.Integral) and x >= low

    if not is_int(s, 1):
        raise KVConfigError(f"s must be an int >= 1; got {s!r}")
    if not is_int(singles, 0):
        raise KVConfigError(f"singles must be an int >= 0; got {singles!r}")
    if not isinstance(cycle, (tuple, list)) or not cycle or not all(is_int(c, 1) for c in cycle):
        raise KVConfigError(f"cycle must be a non-empty sequence of ints >= 1; got {cycle!r}")
    if s == 1:
        return [1]
    chunks = [s // 2]
    rest = s - chunks[0]
    n_single = min(singles, rest)
    chunks += [1] * n_single
    rest -= n_single
    i = 0
    while rest > 0:
        chunks.append(min(cycle[i % len(cycle)], rest))
        rest -= chunks[-1]
        i += 1
    return chunks


def _tokens(vector: TestVector, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``start:stop`` of a vector, wrapping around past its end (for extra steps)."""
    idx = np.arange(start, stop) % vector.shape[2]
    return (
        np.ascontiguousarray(np.take(vector.keys, idx, axis=2)),
        np.ascontiguousarray(np.take(vector.values, idx, axis=2)),
    )


def _native(adapter: Adapter, keys: np.ndarray, values: np.ndarray, dtype: str):
    return adapter.to_native(keys, dtype), adapter.to_native(values, dtype)


def _np(adapter: Adapter, array: Any) -> np.ndarray:
    """Backend array -> a float32 numpy copy (never a view of the cache's memory)."""
    return np.array(adapter.to_numpy(adapter.sync(array)), dtype=np.float32, copy=True)


def _shape(array: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in array.shape)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def _first_bit_difference(a: np.ndarray, b: np.ndarray) -> str:
    if a.shape != b.shape:
        return f"shape {a.shape} vs {b.shape}"
    diff = np.argwhere(a.view(np.uint32) != b.view(np.uint32))
    idx = tuple(int(i) for i in diff[0])
    return f"{len(diff)} elements differ, first at [B,H,S,D]={idx}: {a[idx]!r} vs {b[idx]!r}"


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """``||got - want||_F / ||want||_F`` in float64 (absolute error when ``want`` is all zero).

    ``got`` and ``want`` must have the same shape: broadcasting would compare a slice with a whole.
    """
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise ValueError(f"relative_error: got shape {got.shape} and want shape {want.shape} must be equal")
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    err = float(np.linalg.norm(got64 - want64))
    ref = float(np.linalg.norm(want64))
    return err / ref if ref > 0 else err


def _held_nbytes(adapter: Adapter, cache: KVCacheLayer) -> int:
    return int(sum(int(a.nbytes) for a in adapter.held_arrays(cache)))


def _raw_nbytes(vector_shape: tuple[int, ...], dv: int, offset: int, dtype: str) -> int:
    b, h, _, d = vector_shape
    return b * h * offset * (d + dv) * ITEMSIZE[dtype]


@dataclass
class _Snapshot:
    offset: int
    nbytes: int
    raw_nbytes: int
    empty: bool
    arrays: list[np.ndarray]


def _snapshot(adapter: Adapter, cache: KVCacheLayer) -> _Snapshot:
    return _Snapshot(
        offset=int(cache.offset),
        nbytes=int(cache.nbytes),
        raw_nbytes=int(cache.raw_nbytes),
        empty=bool(cache.empty()),
        arrays=[adapter.snapshot_array(a) for a in adapter.held_arrays(cache)],
    )


def _same_snapshot(before: _Snapshot, after: _Snapshot) -> str | None:
    """None when equal, else what changed."""
    for attr in ("offset", "nbytes", "raw_nbytes", "empty"):
        if getattr(before, attr) != getattr(after, attr):
            return f"{attr} changed from {getattr(before, attr)} to {getattr(after, attr)}"
    if len(before.arrays) != len(after.arrays):
        return f"number of held arrays changed from {len(before.arrays)} to {len(after.arrays)}"
    for i, (a, b) in enumerate(zip(before.arrays, after.arrays, strict=True)):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"held array {i} changed from {a.dtype}{a.shape} to {b.dtype}{b.shape}"
        if a.tobytes() != b.tobytes():
            return f"held array {i} ({a.dtype}{a.shape}) changed its contents"
    return None


def _check_faithful(
    where: str, case: CacheConfigCase, vector: TestVector, got: np.ndarray, want: np.ndarray, label: str
) -> None:
    """Hold ``got`` to the strongest promise the case makes: bitwise, rounding, or tolerance."""
    caps = case.capabilities
    if caps.bitwise_lossless:
        if not _bits_equal(got, want):
            _fail(where, f"{label} are not bitwise equal to the input: {_first_bit_difference(got, want)}")
    elif caps.lossless:
        eps, tiny = _EPS[vector.dtype], _TINY[vector.dtype]
        bad = np.abs(got.astype(np.float64) - want) > eps * np.abs(want.astype(np.float64)) + tiny
        if got.shape != want.shape or np.any(bad):
            _fail(
                where,
                f"{label} differ from the input beyond {vector.dtype} rounding "
                f"({int(np.count_nonzero(bad))} elements; relative error {relative_error(got, want):.3e})",
            )
    else:
        tol = case.tolerance_for(vector.family)
        err = relative_error(got, want)
        if not err <= tol:
            _fail(
                where,
                f"{label} relative Frobenius error {err:.4e} exceeds the declared tolerance {tol:.4e} "
                f"for family {vector.family!r}",
            )


def _per_config_vector(
    dtype: str, s: int = 48, seed: int = 777, shape_bh: tuple[int, int] = (1, 2)
) -> TestVector:
    """A small planted low-rank vector for the once-per-config checks."""
    shape = (shape_bh[0], shape_bh[1], s, 64)
    keys, values = planted_lowrank(shape, seed)
    return TestVector(
        name=f"config_{dtype}",
        family="planted_lowrank",
        dtype=dtype,
        keys=round_to_dtype(keys.astype(np.float32), dtype),
        values=round_to_dtype(values.astype(np.float32), dtype),
        provenance={"generator": "kvspec.synthetic.planted_lowrank", "seed": seed},
    )


def _applicable(adapter: Adapter, vector: TestVector | None, name: str) -> bool:
    if vector is None:
        raise ValueError(f"check_{name} runs once per test vector; pass vector=")
    return vector.dtype in adapter.dtypes


def _stream(adapter: Adapter, cache: KVCacheLayer, vector: TestVector, chunks: list[int], start: int = 0):
    """Feed ``chunks`` of the vector from ``start``; yield ``(offset_expected, keys_out, values_out)``."""
    for n in chunks:
        k, v = _native(adapter, *_tokens(vector, start, start + n), vector.dtype)
        out_k, out_v = cache.update_and_fetch(k, v)
        start += n
        yield start, out_k, out_v


def _expect_error(where: str, what: str, error: type[Exception], call: Callable[[], Any]) -> None:
    try:
        call()
    except error:
        return
    except Exception as exc:  # noqa: BLE001 - any other type is the finding
        _fail(where, f"{what}: raised {type(exc).__name__}({exc}) instead of {error.__name__}")
    _fail(where, f"{what}: was accepted; expected {error.__name__}")


# =========================================================================== registry
@dataclass(frozen=True)
class Check:
    """A registered check: ``per_vector`` checks run once per test vector, the others once per
    configuration; ``applies(capabilities)`` says whether the case's promises make it relevant."""

    name: str
    function: Callable[..., str]
    per_vector: bool
    applies: Callable[[Capabilities], bool]

    @property
    def doc(self) -> str:
        return " ".join((self.function.__doc__ or "").split())


def _always(_: Capabilities) -> bool:
    return True


_REGISTERED: list[Check] = []


def _check(name: str, per_vector: bool, applies: Callable[[Capabilities], bool] = _always):
    """Register ``check_<name>``: the decorated body states the check only; the wrapper returns
    :data:`NOT_APPLICABLE` when ``applies(case.capabilities)`` is False or (``per_vector``) the
    vector's dtype is not one the adapter accepts, and :data:`PASSED` when the body returns."""

    def register(body: Callable[[Adapter, CacheConfigCase, TestVector | None], None]) -> Callable[..., str]:
        def check(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None) -> str:
            if not applies(case.capabilities):
                return NOT_APPLICABLE
            if per_vector and not _applicable(adapter, vector, name):
                return NOT_APPLICABLE
            body(adapter, case, vector)
            return PASSED

        functools.update_wrapper(check, body, assigned=("__module__", "__name__", "__qualname__", "__doc__"))
        _REGISTERED.append(Check(name, check, per_vector, applies))
        return check

    return register


# =========================================================================== per-config checks
@_check("protocol", False)
def check_protocol(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None) -> None:
    """A new cache is empty at offset 0 with no raw bytes; it satisfies ``KVCacheLayer``; its
    ``is_trimmable()`` matches the declared capability (and a non-trimmable cache's ``trim``
    raises ``KVTrimError`` changing nothing); ``meta_state`` is plain strings."""
    caps = case.capabilities
    for dtype in adapter.dtypes:
        where = _where(adapter, case, extra=dtype)
        cache = adapter.make(case.config)
        if not isinstance(cache, KVCacheLayer):
            missing = [
                m
                for m in (
                    "offset",
                    "update_and_fetch",
                    "nbytes",
                    "raw_nbytes",
                    "is_trimmable",
                    "trim",
                    "state",
                )
                + ("meta_state", "empty")
                if not hasattr(cache, m)
            ]
            _fail(where, f"{type(cache).__name__} does not satisfy KVCacheLayer (missing {missing})")
        if cache.offset != 0 or not cache.empty():
            _fail(
                where,
                f"a new cache must be empty at offset 0; got offset {cache.offset}, empty() {cache.empty()}",
            )
        if cache.raw_nbytes != 0:
            _fail(where, f"a new cache must have raw_nbytes 0; got {cache.raw_nbytes}")
        if bool(cache.is_trimmable()) != caps.trimmable:
            _fail(
                where,
                f"is_trimmable() returns {cache.is_trimmable()} but the case declares trimmable={caps.trimmable}",
            )
        vec = _per_config_vector(dtype, s=8)
        cache.update_and_fetch(*_native(adapter, vec.keys, vec.values, dtype))
        if cache.empty() or cache.offset != 8:
            _fail(where, f"after 8 tokens: offset {cache.offset}, empty() {cache.empty()}")
        for x in (cache.nbytes, cache.raw_nbytes, cache.offset):
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                _fail(where, f"offset, nbytes and raw_nbytes must be ints; got {type(x).__name__}")
        meta = cache.meta_state
        leaves = flatten_meta(meta)
        if not all(isinstance(leaf, str) for leaf in leaves):
            _fail(where, f"meta_state must hold only strings; got {meta!r}")
        if not caps.trimmable:
            before = _snapshot(adapter, cache)
            _expect_error(where, "trim(1) on a non-trimmable cache", KVTrimError, lambda c=cache: c.trim(1))
            change = _same_snapshot(before, _snapshot(adapter, cache))
            if change:
                _fail(where, f"a rejected trim changed the cache: {change}")


def flatten_meta(meta: Any) -> list[Any]:
    """The leaves of a ``meta_state`` tree (tuple / list / dict values)."""
    if isinstance(meta, dict):
        return [leaf for value in meta.values() for leaf in flatten_meta(value)]
    if isinstance(meta, (tuple, list)):
        return [leaf for item in meta for leaf in flatten_meta(item)]
    return [meta]


def _bad_inputs(b: int, h: int, s: int, d: int, dv: int, dtypes: tuple[str, ...], dtype: str, fresh: bool):
    """``(description, keys_shape, values_shape, keys_dtype, values_dtype, error)`` rejected inputs.

    On a fresh cache only inputs that are wrong on their own; mid-stream also changes of B/H/D/Dv.
    """
    cases = [
        ("keys and values of rank 3 [H, S, D]", (h, s, d), (h, s, dv), dtype, dtype, KVShapeError),
        ("keys and values of rank 5", (1, b, h, s, d), (1, b, h, s, dv), dtype, dtype, KVShapeError),
        ("values with a different S", (b, h, s, d), (b, h, s + 1, dv), dtype, dtype, KVShapeError),
        ("values with a different H", (b, h, s, d), (b, h + 1, s, dv), dtype, dtype, KVShapeError),
        ("values with a different B", (b, h, s, d), (b + 1, h, s, dv), dtype, dtype, KVShapeError),
    ]
    if not fresh:
        cases += [
            ("B changed mid-stream", (b + 1, h, s, d), (b + 1, h, s, dv), dtype, dtype, KVShapeError),
            ("H changed mid-stream", (b, h + 1, s, d), (b, h + 1, s, dv), dtype, dtype, KVShapeError),
            ("D changed mid-stream", (b, h, s, d + 8), (b, h, s, dv + 8), dtype, dtype, KVShapeError),
            ("Dv changed mid-stream", (b, h, s, d), (b, h, s, dv + 8), dtype, dtype, KVShapeError),
        ]
    other = [t for t in dtypes if t != dtype]
    if other:
        cases.append(
            (
                "keys and values of different dtypes",
                (b, h, s, d),
                (b, h, s, dv),
                dtype,
                other[0],
                KVDtypeError,
            )
        )
    return cases


def _rejections_leave_cache_unchanged(
    adapter: Adapter,
    case: CacheConfigCase,
    dtype: str,
    bad: Callable[[TestVector, bool], list[tuple[str, Any, Any, type[Exception]]]],
) -> None:
    """Run every rejected input from ``bad`` on a fresh and a prefilled cache; each must raise
    its error and leave the cache exactly as it was, and the next valid update must give the
    same output as on an untouched twin."""
    vec = _per_config_vector(dtype, s=48)
    for fresh in (True, False):
        where = _where(adapter, case, extra=f"{dtype} {'fresh' if fresh else 'after a 32-token prefill'}")
        cache, twin = adapter.make(case.config), adapter.make(case.config)
        if not fresh:
            for c in (cache, twin):
                c.update_and_fetch(*_native(adapter, *_tokens(vec, 0, 32), dtype))
        for description, keys, values, error in bad(vec, fresh):
            before = _snapshot(adapter, cache)
            _expect_error(
                where, description, error, lambda c=cache, k=keys, v=values: c.update_and_fetch(k, v)
            )
            change = _same_snapshot(before, _snapshot(adapter, cache))
            if change:
                _fail(where, f"rejected input ({description}) changed the cache: {change}")
        start = 0 if fresh else 32
        nxt = _native(adapter, *_tokens(vec, start, start + 5), dtype)
        got = [_np(adapter, x) for x in cache.update_and_fetch(*nxt)]
        want = [
            _np(adapter, x)
            for x in twin.update_and_fetch(*_native(adapter, *_tokens(vec, start, start + 5), dtype))
        ]
        if cache.offset != twin.offset:
            _fail(
                where,
                f"after the rejected inputs, offset {cache.offset} differs from an untouched twin's {twin.offset}",
            )
        for label, g, w in zip(("keys", "values"), got, want, strict=True):
            if g.shape != w.shape:
                _fail(
                    where,
                    f"after the rejected inputs, {label} shape {g.shape} differs from the twin's {w.shape}",
                )
            if case.capabilities.deterministic and not _bits_equal(g, w):
                _fail(
                    where,
                    f"after the rejected inputs, the next update's {label} differ from an untouched twin's: "
                    f"{_first_bit_difference(g, w)}",
                )


@_check("bad_input", False)
def check_bad_input(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None) -> None:
    """Wrong rank, K/V shapes that disagree, B/H/D/Dv changed mid-stream, and K/V of different
    dtypes raise ``KVShapeError`` / ``KVDtypeError`` and leave the cache exactly as it was."""

    for dtype in adapter.dtypes:

        def bad(vec: TestVector, fresh: bool, dtype: str = dtype):
            b, h, _, d = vec.shape
            dv = vec.values_shape[3]
            rng = np.random.default_rng(5)
            out = []
            for description, kshape, vshape, kdt, vdt, error in _bad_inputs(
                b, h, 2, d, dv, adapter.dtypes, dtype, fresh
            ):
                k = round_to_dtype(rng.standard_normal(kshape).astype(np.float32), kdt)
                v = round_to_dtype(rng.standard_normal(vshape).astype(np.float32), vdt)
                out.append((description, adapter.to_native(k, kdt), adapter.to_native(v, vdt), error))
            return out

        _rejections_leave_cache_unchanged(adapter, case, dtype, bad)


@_check("rejects_nonfinite", False, lambda c: c.rejects_nonfinite)
def check_rejects_nonfinite(
    adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None
) -> None:
    """NaN and +/-infinity in keys or values raise ``KVValueError`` and change nothing."""
    for dtype in adapter.dtypes:

        def bad(vec: TestVector, fresh: bool, dtype: str = dtype):
            start = 0 if fresh else 32
            out = []
            for description, tensor, position, value in (
                ("NaN in keys", 0, (0, 0, 1, 3), np.nan),
                ("+inf in values", 1, (0, 1, 0, 0), np.inf),
                ("-inf in keys", 0, (0, 0, 2, 5), -np.inf),
            ):
                k, v = (np.array(a) for a in _tokens(vec, start, start + 3))
                (k, v)[tensor][position] = value
                out.append(
                    (description, adapter.to_native(k, dtype), adapter.to_native(v, dtype), KVValueError)
                )
            return out

        _rejections_leave_cache_unchanged(adapter, case, dtype, bad)


@_check("compresses", False, lambda c: c.compresses)
def check_compresses(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None) -> None:
    """A compressing configuration holds fewer bytes than raw once ``adapter.long_seq`` tokens of
    planted low-rank data (B=1, H=4, D=64) are in, for every dtype the adapter accepts."""
    for dtype in adapter.dtypes:
        where = _where(adapter, case, extra=f"{dtype} S={adapter.long_seq}")
        vec = _per_config_vector(dtype, s=adapter.long_seq, seed=778, shape_bh=(1, 4))
        cache = adapter.make(case.config)
        for _ in _stream(adapter, cache, vec, stream_schedule(vec.shape[2])):
            pass
        if not cache.nbytes < cache.raw_nbytes:
            _fail(
                where,
                f"declares compresses=True but holds {cache.nbytes} bytes for {cache.raw_nbytes} raw bytes "
                f"(ratio {cache.nbytes / max(cache.raw_nbytes, 1):.3f})",
            )


# =========================================================================== per-vector checks
@_check("shape_dtype", True)
def check_shape_dtype(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None) -> None:
    """One prefill of the whole vector, then one more token: outputs are ``[B, H, S_total, D]`` /
    ``[B, H, S_total, Dv]`` in the input dtype."""
    where = _where(adapter, case, vector)
    b, h, s, d = vector.shape
    dv = vector.values_shape[3]
    cache = adapter.make(case.config)
    for step, (total, k, v) in enumerate(_stream(adapter, cache, vector, [s, 1])):
        for label, out, want in (("keys", k, (b, h, total, d)), ("values", v, (b, h, total, dv))):
            if _shape(out) != want:
                _fail(where, f"step {step}: {label} output shape {_shape(out)}, expected {want}")
            got_dtype = adapter.dtype_name(out)
            if got_dtype != vector.dtype:
                _fail(
                    where,
                    f"step {step}: {label} output dtype {got_dtype}, expected the input dtype {vector.dtype}",
                )


@_check("offset_accounting", True)
def check_offset_accounting(
    adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None
) -> None:
    """Over a prefill, many single-token steps and multi-token appends, ``offset`` is always the
    number of tokens fed, outputs have that length, and ``empty()`` turns False."""
    where = _where(adapter, case, vector)
    cache = adapter.make(case.config)
    if cache.offset != 0 or not cache.empty():
        _fail(where, f"new cache: offset {cache.offset}, empty() {cache.empty()}; expected 0, True")
    chunks = stream_schedule(vector.shape[2])
    for step, (total, k, v) in enumerate(_stream(adapter, cache, vector, chunks)):
        if cache.offset != total:
            _fail(where, f"step {step} (chunk of {chunks[step]}): offset {cache.offset}, expected {total}")
        if _shape(k)[2] != total or _shape(v)[2] != total:
            _fail(where, f"step {step}: output lengths {_shape(k)[2]}, {_shape(v)[2]}; expected {total}")
        if cache.empty():
            _fail(where, f"step {step}: empty() is True after {total} tokens")


@_check("causal_stability", True, lambda c: c.causal_stable)
def check_causal_stability(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None) -> None:
    """Positions already returned never change, bitwise, after later appends."""
    where = _where(adapter, case, vector)
    cache = adapter.make(case.config)
    previous: tuple[np.ndarray, np.ndarray] | None = None
    for step, (_total, k, v) in enumerate(_stream(adapter, cache, vector, stream_schedule(vector.shape[2]))):
        current = (_np(adapter, k), _np(adapter, v))
        if previous is not None:
            for label, old, new in zip(("keys", "values"), previous, current, strict=True):
                past = new[:, :, : old.shape[2]]
                if not _bits_equal(past, old):
                    _fail(where, f"step {step}: earlier {label} changed: {_first_bit_difference(past, old)}")
        previous = current


@_check("lossless", True, lambda c: c.lossless or c.bitwise_lossless)
def check_lossless(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None) -> None:
    """Lossless configurations return the input at every step: bit for bit where
    ``bitwise_lossless``, else within the rounding of the input dtype."""
    cache = adapter.make(case.config)
    for step, (total, k, v) in enumerate(_stream(adapter, cache, vector, stream_schedule(vector.shape[2]))):
        where = _where(adapter, case, vector, f"step {step}")
        _check_faithful(where, case, vector, _np(adapter, k), vector.keys[:, :, :total], "keys")
        _check_faithful(where, case, vector, _np(adapter, v), vector.values[:, :, :total], "values")


@_check("reconstruction_error", True)
def check_reconstruction_error(
    adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None
) -> None:
    """Relative Frobenius error of keys and of values, after the prefill and after the whole
    stream, is within ``case.tolerance_for(vector.family)``."""
    tol = case.tolerance_for(vector.family)
    cache = adapter.make(case.config)
    chunks = stream_schedule(vector.shape[2])
    for step, (total, k, v) in enumerate(_stream(adapter, cache, vector, chunks)):
        if step not in (0, len(chunks) - 1):
            continue
        where = _where(adapter, case, vector, "after the prefill" if step == 0 else "after the whole stream")
        for label, out, ref in (("keys", k, vector.keys), ("values", v, vector.values)):
            err = relative_error(_np(adapter, out), ref[:, :, :total])
            if not err <= tol:
                _fail(
                    where,
                    f"{label} relative Frobenius error {err:.4e} exceeds the tolerance {tol:.4e} "
                    f"declared for family {vector.family!r}",
                )


@_check("byte_honesty", True)
def check_byte_honesty(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None) -> None:
    """At every step ``nbytes`` equals the summed ``.nbytes`` of the arrays held
    (``adapter.held_arrays``) and ``raw_nbytes`` is ``B*H*offset*(D+Dv)*itemsize``."""
    dv = vector.values_shape[3]
    cache = adapter.make(case.config)

    def verify(step: str) -> None:
        where = _where(adapter, case, vector, step)
        held = _held_nbytes(adapter, cache)
        if cache.nbytes != held:
            _fail(where, f"nbytes reports {cache.nbytes} but the arrays held sum to {held} bytes")
        raw = _raw_nbytes(vector.shape, dv, cache.offset, vector.dtype)
        if cache.raw_nbytes != raw:
            _fail(where, f"raw_nbytes reports {cache.raw_nbytes}; B*H*offset*(D+Dv)*itemsize is {raw}")

    verify("new cache")
    for step, _ in enumerate(_stream(adapter, cache, vector, stream_schedule(vector.shape[2]))):
        verify(f"step {step}")


@_check("determinism", True, lambda c: c.deterministic)
def check_determinism(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None) -> None:
    """Two fresh caches fed the same stream return bitwise equal outputs and equal ``nbytes``."""
    chunks = stream_schedule(vector.shape[2])
    first, second = adapter.make(case.config), adapter.make(case.config)
    streams = zip(
        _stream(adapter, first, vector, chunks), _stream(adapter, second, vector, chunks), strict=True
    )
    for step, ((_, k1, v1), (_, k2, v2)) in enumerate(streams):
        where = _where(adapter, case, vector, f"step {step}")
        for label, a, b in (("keys", k1, k2), ("values", v1, v2)):
            a, b = _np(adapter, a), _np(adapter, b)
            if not _bits_equal(a, b):
                _fail(where, f"two identical runs differ in {label}: {_first_bit_difference(a, b)}")
        if first.nbytes != second.nbytes:
            _fail(where, f"two identical runs hold {first.nbytes} and {second.nbytes} bytes")


@_check("trim", True, lambda c: c.trimmable)
def check_trim(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None) -> None:
    """``trim(0)`` is a no-op; ``trim(-1)`` raises ``KVTrimError`` changing nothing; ``trim(k)``
    drops k tokens (offset, raw bytes, honest nbytes); re-appending them restores a faithful
    output (earlier positions bitwise unchanged where causal-stable); ``trim`` past the start
    clamps to ``offset`` and the cache takes new tokens afterwards."""
    caps = case.capabilities
    where = _where(adapter, case, vector)
    s, dv = vector.shape[2], vector.values_shape[3]
    cache = adapter.make(case.config)
    if not cache.is_trimmable():
        _fail(where, "is_trimmable() is False for a case declared trimmable")
    k_full = v_full = None
    for _, k, v in _stream(adapter, cache, vector, stream_schedule(s)):
        k_full, v_full = k, v
    k_full, v_full = _np(adapter, k_full), _np(adapter, v_full)

    def expect_state(step: str, offset: int) -> None:
        if cache.offset != offset:
            _fail(where, f"{step}: offset {cache.offset}, expected {offset}")
        raw = _raw_nbytes(vector.shape, dv, offset, vector.dtype)
        if cache.raw_nbytes != raw:
            _fail(where, f"{step}: raw_nbytes {cache.raw_nbytes}, expected {raw}")
        held = _held_nbytes(adapter, cache)
        if cache.nbytes != held:
            _fail(where, f"{step}: nbytes {cache.nbytes} but the arrays held sum to {held}")

    before = _snapshot(adapter, cache)
    dropped = cache.trim(0)
    if dropped != 0:
        _fail(where, f"trim(0) returned {dropped}, expected 0")
    change = _same_snapshot(before, _snapshot(adapter, cache))
    if change:
        _fail(where, f"trim(0) changed the cache: {change}")
    _expect_error(where, "trim(-1)", KVTrimError, lambda: cache.trim(-1))
    change = _same_snapshot(before, _snapshot(adapter, cache))
    if change:
        _fail(where, f"a rejected trim(-1) changed the cache: {change}")

    k = min(5, s)
    dropped = cache.trim(k)
    if dropped != k:
        _fail(where, f"trim({k}) at offset {s} returned {dropped}, expected {k}")
    expect_state(f"after trim({k})", s - k)

    k_out, v_out = (
        _np(adapter, x)
        for x in cache.update_and_fetch(*_native(adapter, *_tokens(vector, s - k, s), vector.dtype))
    )
    expect_state(f"after trim({k}) and re-appending {k} tokens", s)
    if caps.causal_stable:
        for label, new, old in (("keys", k_out, k_full), ("values", v_out, v_full)):
            if not _bits_equal(new[:, :, : s - k], old[:, :, : s - k]):
                _fail(
                    where,
                    f"positions before the trim point changed in {label}: "
                    f"{_first_bit_difference(new[:, :, : s - k], old[:, :, : s - k])}",
                )
    _check_faithful(where + " after trim and re-append", case, vector, k_out, vector.keys, "keys")
    _check_faithful(where + " after trim and re-append", case, vector, v_out, vector.values, "values")

    dropped = cache.trim(s + 7)
    if dropped != s:
        _fail(where, f"trim({s + 7}) at offset {s} returned {dropped}; it must clamp to {s}")
    expect_state(f"after trim({s + 7})", 0)

    n = min(s, 16)
    k_out, v_out = (
        _np(adapter, x)
        for x in cache.update_and_fetch(*_native(adapter, *_tokens(vector, 0, n), vector.dtype))
    )
    expect_state(f"after trimming everything and adding {n} tokens", n)
    _check_faithful(where + " after trimming everything", case, vector, k_out, vector.keys[:, :, :n], "keys")
    _check_faithful(
        where + " after trimming everything", case, vector, v_out, vector.values[:, :, :n], "values"
    )


@_check("serialization", True, lambda c: c.serializable)
def check_serialization(adapter: Adapter, case: CacheConfigCase, vector: TestVector | None = None) -> None:
    """A cache rebuilt by ``adapter.restore(state, meta_state, config)`` mid-stream has the same
    offset and raw bytes, honest ``nbytes``, and gives identical outputs to the original for
    the rest of the stream (and, where trimmable, after a trim)."""
    caps = case.capabilities
    where = _where(adapter, case, vector)
    chunks = stream_schedule(vector.shape[2])
    split = max(1, len(chunks) // 2)
    original = adapter.make(case.config)
    for _ in _stream(adapter, original, vector, chunks[:split]):
        pass
    meta = original.meta_state
    if not all(isinstance(leaf, str) for leaf in flatten_meta(meta)):
        _fail(where, f"meta_state must hold only strings; got {meta!r}")
    restored = adapter.restore(original.state, meta, case.config)
    for attr in ("offset", "raw_nbytes"):
        if getattr(restored, attr) != getattr(original, attr):
            _fail(where, f"restored {attr} {getattr(restored, attr)} != original {getattr(original, attr)}")
    held = _held_nbytes(adapter, restored)
    if restored.nbytes != held:
        _fail(where, f"restored cache reports nbytes {restored.nbytes} but holds {held} bytes")

    start = sum(chunks[:split])
    rest = chunks[split:] or [1]  # a one-chunk stream continues with a wrapped-around token
    pairs = zip(
        _stream(adapter, original, vector, rest, start),
        _stream(adapter, restored, vector, rest, start),
        strict=True,
    )
    for step, ((_, k1, v1), (_, k2, v2)) in enumerate(pairs):
        step_where = _where(adapter, case, vector, f"step {step} after restore")
        _compare_outputs(adapter, case, vector, step_where, (k1, v1), (k2, v2), "original", "restored")
        if restored.offset != original.offset:
            _fail(step_where, f"restored offset {restored.offset} != original {original.offset}")
    if caps.trimmable:
        original.trim(2)
        restored.trim(2)
        end = original.offset
        outs = [
            c.update_and_fetch(*_native(adapter, *_tokens(vector, end, end + 2), vector.dtype))
            for c in (original, restored)
        ]
        _compare_outputs(
            adapter,
            case,
            vector,
            where + " after trim(2) and 2 tokens",
            outs[0],
            outs[1],
            "original",
            "restored",
        )


def _compare_outputs(adapter, case, vector, where, first, second, name1, name2) -> None:
    for label, a, b in zip(("keys", "values"), first, second, strict=True):
        a, b = _np(adapter, a), _np(adapter, b)
        if case.capabilities.deterministic:
            if not _bits_equal(a, b):
                _fail(where, f"{name2} {label} differ from the {name1}'s: {_first_bit_difference(a, b)}")
        elif a.shape != b.shape:
            _fail(where, f"{name2} {label} shape {b.shape} differs from the {name1}'s {a.shape}")


CHECKS: dict[str, Check] = {c.name: c for c in _REGISTERED}


@dataclass(frozen=True)
class CheckItem:
    """One applicable (adapter, case, vector, check) combination."""

    adapter: Adapter
    case: CacheConfigCase
    check: Check
    vector: TestVector | None

    @property
    def id(self) -> str:
        """``<adapter>-<case>-<vector or "config">-<check>``."""
        vector = self.vector.name if self.vector is not None else "config"
        return f"{self.adapter.name}-{self.case.name}-{vector}-{self.check.name}"

    def run(self) -> str:
        return self.check.function(self.adapter, self.case, self.vector)


def conformance_items(
    adapter: Adapter, vectors: list[TestVector] | None = None, checks: list[str] | None = None
) -> list[CheckItem]:
    """Every applicable item: only checks whose capability the case has, and only vectors
    whose dtype is in ``adapter.dtypes`` (default vectors: all shipped ones)."""
    vectors = load_vectors() if vectors is None else vectors
    vectors = [v for v in vectors if v.dtype in adapter.dtypes]
    selected = [CHECKS[name] for name in checks] if checks is not None else list(CHECKS.values())
    items: list[CheckItem] = []
    names = [case.name for case in adapter.configs()]
    if len(set(names)) != len(names):
        raise ValueError(f"{adapter.name} adapter: config case names must be unique; got {names}")
    for case in adapter.configs():
        for check in selected:
            if not check.applies(case.capabilities):
                continue
            if check.per_vector:
                items.extend(CheckItem(adapter, case, check, v) for v in vectors)
            else:
                items.append(CheckItem(adapter, case, check, None))
    return items


def run_conformance(
    adapter: Adapter, vectors: list[TestVector] | None = None
) -> Iterator[tuple[str, str | None]]:
    """Run every applicable item; yield ``(id, None)`` on a pass or ``(id, message)`` on a failure."""
    for item in conformance_items(adapter, vectors):
        try:
            item.run()
        except ConformanceError as exc:
            yield item.id, str(exc)
        else:
            yield item.id, None


def _load_adapter(spec: str) -> Adapter:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvspec.conformance module:AdapterClass``: run every check, print failures."""
    parser = argparse.ArgumentParser(prog="python -m kvspec.conformance")
    parser.add_argument("adapter", help="module:Class of an Adapter, e.g. kvspec.reference:ReferenceAdapter")
    args = parser.parse_args(argv)
    failures = total = 0
    for item_id, message in run_conformance(_load_adapter(args.adapter)):
        total += 1
        if message is not None:
            failures += 1
            print(f"FAIL {item_id}: {message}")
    print(f"{total - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
