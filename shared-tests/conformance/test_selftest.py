"""The conformance checks prove themselves: good caches pass every one, and a deliberately
broken variant of the reference is caught by each check.

The good caches are the lossless reference and a small lossy, compressing int8 cache defined
here (so ``compresses`` and the tolerance path are proven passable too). Each broken cache
changes one behaviour of :class:`NumpyReferenceCache`; the table ``BROKEN`` says which check
must catch it, on which vector, with which message.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
from kvspec import (
    CacheConfigCase,
    Capabilities,
    KVConfigError,
    KVDtypeError,
    KVShapeError,
    KVTrimError,
    KVValueError,
    check_kv_pair,
)
from kvspec.conformance import CHECKS, NOT_APPLICABLE, PASSED, ConformanceError, conformance_items
from kvspec.reference import NumpyReferenceCache, ReferenceAdapter, ReferenceConfig
from kvspec.vectors import get_vector, load_vectors, round_to_dtype

LOSSY = Capabilities(lossless=False, bitwise_lossless=False)


# =========================================================================== a good lossy cache
class Int8TokenCache:
    """Per-token absmax int8 codes plus a float32 scale per token and head: lossy (~1 %),
    causal-stable (each token coded on its own) and about 2-4x smaller than raw."""

    def __init__(self, step: int = 64) -> None:
        self.step = step
        self._buffers: list[np.ndarray] | None = None  # key codes, key scales, value codes, value scales
        self._dtype: np.dtype | None = None
        self._offset = 0

    offset = property(lambda self: self._offset)

    def empty(self) -> bool:
        return self._buffers is None

    def update_and_fetch(self, keys, values):
        if not isinstance(keys, np.ndarray) or not isinstance(values, np.ndarray):
            raise KVDtypeError("keys and values must be numpy arrays")
        expected = None
        if self._buffers is not None:
            kq, _, vq, _ = self._buffers
            expected = (kq.shape[0], kq.shape[1], kq.shape[3], vq.shape[3])
        b, h, s, d, dv = check_kv_pair(keys.shape, values.shape, keys.dtype, values.dtype, expected)
        if keys.dtype not in (np.float32, np.float16) or (
            self._dtype is not None and keys.dtype != self._dtype
        ):
            raise KVDtypeError(f"keys dtype must be float32 or float16 and stay fixed; got {keys.dtype}")
        if not (np.all(np.isfinite(keys)) and np.all(np.isfinite(values))):
            raise KVValueError("keys and values must be finite")
        end = self._offset + s
        if self._buffers is None or end > self._buffers[0].shape[2]:
            cap = -(-end // self.step) * self.step
            grown = [
                np.zeros((b, h, cap, d), np.int8),
                np.zeros((b, h, cap, 1), np.float32),
                np.zeros((b, h, cap, dv), np.int8),
                np.zeros((b, h, cap, 1), np.float32),
            ]
            if self._buffers is not None:
                for new, old in zip(grown, self._buffers, strict=True):
                    new[:, :, : self._offset] = old[:, :, : self._offset]
            self._buffers = grown
        self._dtype = keys.dtype
        for i, x in ((0, keys), (2, values)):
            x = x.astype(np.float32)
            scale = np.maximum(np.abs(x).max(axis=3, keepdims=True), 1e-30) / 127.0
            self._buffers[i][:, :, self._offset : end] = np.round(x / scale).astype(np.int8)
            self._buffers[i + 1][:, :, self._offset : end] = scale
        self._offset = end
        return self._decode(0), self._decode(2)

    def _decode(self, i: int) -> np.ndarray:
        codes, scales = self._buffers[i][:, :, : self._offset], self._buffers[i + 1][:, :, : self._offset]
        return (codes.astype(np.float32) * scales).astype(self._dtype)

    nbytes = property(lambda self: 0 if self._buffers is None else int(sum(a.nbytes for a in self._buffers)))

    @property
    def raw_nbytes(self) -> int:
        if self._buffers is None:
            return 0
        kq, _, vq, _ = self._buffers
        return kq.shape[0] * kq.shape[1] * self._offset * (kq.shape[3] + vq.shape[3]) * self._dtype.itemsize

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise KVTrimError(f"trim(n) needs an int n >= 0; got {n!r}")
        dropped = min(n, self._offset)
        self._offset -= dropped
        return dropped

    @property
    def state(self):
        return () if self._buffers is None else tuple(a[:, :, : self._offset] for a in self._buffers)

    @property
    def meta_state(self):
        return (str(self._offset), "" if self._dtype is None else self._dtype.name, str(self.step))

    @classmethod
    def from_state(cls, state, meta_state):
        offset, dtype, step = meta_state
        cache = cls(int(step))
        if state:
            if any(a.shape[2] != int(offset) for a in state):
                raise KVConfigError("state length does not match meta_state offset")
            cache._buffers = [np.array(a, copy=True) for a in state]
            cache._dtype, cache._offset = np.dtype(dtype), int(offset)
        return cache


class Int8Adapter(ReferenceAdapter):
    name = "int8"

    def configs(self) -> list[CacheConfigCase]:
        caps = Capabilities(lossless=False, bitwise_lossless=False, compresses=True)
        return [CacheConfigCase("absmax", 64, caps, default_tolerance=0.02, tolerance={"outlier_keys": 0.03})]

    def make(self, config: int) -> Int8TokenCache:
        return Int8TokenCache(config)

    def restore(self, state, meta_state, config) -> Int8TokenCache:
        return Int8TokenCache.from_state(state, meta_state)

    def held_arrays(self, cache: Int8TokenCache) -> list[np.ndarray]:
        return [] if cache._buffers is None else list(cache._buffers)


GOOD_ADAPTERS = [ReferenceAdapter(), Int8Adapter()]


# =========================================================================== broken caches
class NotTrimmableClaim(NumpyReferenceCache):
    def is_trimmable(self):
        return False


class NonStringMeta(NumpyReferenceCache):
    @property
    def meta_state(self):
        return (self._offset, str(self.config.step), "1")

    @classmethod
    def from_state(cls, state, meta_state):
        return super().from_state(state, tuple(str(m) for m in meta_state))


class GrowsBeforeValidating(NumpyReferenceCache):
    """Allocates one more token of capacity before checking the input."""

    def update_and_fetch(self, keys, values):
        if self._keys is not None:
            pad = np.zeros_like(self._keys[:, :, :1])
            self._keys = np.concatenate([self._keys, pad], axis=2)
            self._values = np.concatenate([self._values, np.zeros_like(self._values[:, :, :1])], axis=2)
        return super().update_and_fetch(keys, values)


class WrongErrorType(NumpyReferenceCache):
    def update_and_fetch(self, keys, values):
        try:
            return super().update_and_fetch(keys, values)
        except KVShapeError as exc:
            raise ValueError(str(exc)) from None


class RestartsOnNewShape(NumpyReferenceCache):
    """Silently starts a new stream when B/H/D change instead of rejecting the input."""

    def update_and_fetch(self, keys, values):
        if (
            self._keys is not None
            and keys.ndim == 4
            and keys.shape[:2] + keys.shape[3:] != (self._keys.shape[:2] + self._keys.shape[3:])
        ):
            self._keys = self._values = None
            self._offset = 0
        return super().update_and_fetch(keys, values)


class WritesBeforeRejectingNaN(NumpyReferenceCache):
    """Stores the tokens, then notices they were not finite."""

    def update_and_fetch(self, keys, values):
        self.config = replace(self.config, reject_nonfinite=False)
        out = super().update_and_fetch(keys, values)
        self.config = replace(self.config, reject_nonfinite=True)
        if not (np.all(np.isfinite(keys)) and np.all(np.isfinite(values))):
            raise KVValueError("non-finite input")
        return out


class UpcastsOutput(NumpyReferenceCache):
    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        return k.astype(np.float32), v.astype(np.float32)


class ReturnsOnlyNewTokens(NumpyReferenceCache):
    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        return k[:, :, -keys.shape[2] :], v[:, :, -keys.shape[2] :]


class OffsetOffByOne(NumpyReferenceCache):
    @property
    def offset(self):
        return self._offset + 1 if self._offset > 1 else self._offset


class RequantizesThePast(NumpyReferenceCache):
    """Re-rounds older tokens to bfloat16 precision on every append: lossy and unstable."""

    def update_and_fetch(self, keys, values):
        old = self._offset
        if old:
            self._keys[:, :, :old] = round_to_dtype(self._keys[:, :, :old], "bfloat16")
        return super().update_and_fetch(keys, values)


class StoresFloat16(NumpyReferenceCache):
    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(
            round_to_dtype(keys, "float16").astype(keys.dtype),
            round_to_dtype(values, "float16").astype(values.dtype),
        )


class StoresBfloat16(NumpyReferenceCache):
    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(
            round_to_dtype(keys, "bfloat16").astype(keys.dtype),
            round_to_dtype(values, "bfloat16").astype(values.dtype),
        )


class ScalesByOnePercent(NumpyReferenceCache):
    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        return (k * 1.01).astype(k.dtype), (v * 1.01).astype(v.dtype)


class CorruptsOneToken(NumpyReferenceCache):
    """Lossy only on token 0 of keys; fine on every other position."""

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        k[:, :, 0] *= 3.0
        return k, v


class LiesAboutNbytes(NumpyReferenceCache):
    @property
    def nbytes(self):
        return self.raw_nbytes // 2


class RawNbytesKeysOnly(NumpyReferenceCache):
    @property
    def raw_nbytes(self):
        return super().raw_nbytes // 2


class Nondeterministic(NumpyReferenceCache):
    def __init__(self, config=None):
        super().__init__(config)
        self._rng = np.random.default_rng()  # fresh OS entropy per cache

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        return (k + 1e-6 * self._rng.standard_normal(k.shape)).astype(k.dtype), v


class TrimDropsOneLess(NumpyReferenceCache):
    def trim(self, n):
        dropped = super().trim(n)
        self._offset += 1 if 0 < dropped < n + 1 and self._offset > 0 else 0
        return dropped


class TrimDoesNotClamp(NumpyReferenceCache):
    def trim(self, n):
        super().trim(n)
        return n


class TrimAcceptsNegative(NumpyReferenceCache):
    def trim(self, n):
        if isinstance(n, int) and n < 0:
            return 0
        return super().trim(n)


class TrimKeepsStaleBytes(NumpyReferenceCache):
    """Trim forgets to update raw_nbytes."""

    _trimmed = 0

    def trim(self, n):
        dropped = super().trim(n)
        self._trimmed += dropped
        return dropped

    @property
    def raw_nbytes(self):
        if self._keys is None:
            return 0
        b, h, _, d = self._keys.shape
        return int(b * h * (self._offset + self._trimmed) * (d + self._values.shape[3]) * self._keys.itemsize)


class LossyStateRoundTrip(NumpyReferenceCache):
    @classmethod
    def from_state(cls, state, meta_state):
        rounded = tuple(round_to_dtype(a, "float16").astype(a.dtype) for a in state)
        return super().from_state(rounded, meta_state)


class RestoreForgetsLastToken(NumpyReferenceCache):
    @classmethod
    def from_state(cls, state, meta_state):
        offset, *rest = meta_state
        shorter = tuple(a[:, :, :-1] for a in state)
        return super().from_state(shorter, (str(int(offset) - 1), *rest))


class RestoreForgetsStep(NumpyReferenceCache):
    """Restored cache reports nbytes from a formula rather than its buffers."""

    restored = False

    @classmethod
    def from_state(cls, state, meta_state):
        cache = super().from_state(state, meta_state)
        cache.restored = True
        return cache

    @property
    def nbytes(self):
        return self.raw_nbytes if self.restored else super().nbytes


# =========================================================================== adapter for them
@dataclass
class BrokenAdapter(ReferenceAdapter):
    """The reference adapter driving a broken cache class under a case that claims ``capabilities``."""

    cache_cls: type = NumpyReferenceCache
    capabilities: Capabilities = field(
        default_factory=lambda: Capabilities(lossless=True, bitwise_lossless=True)
    )
    tolerance: float = 0.0
    config: ReferenceConfig = field(default_factory=ReferenceConfig)
    name: str = "broken"

    def configs(self) -> list[CacheConfigCase]:
        return [CacheConfigCase("case", self.config, self.capabilities, self.tolerance)]

    def make(self, config: ReferenceConfig) -> NumpyReferenceCache:
        return self.cache_cls(config)

    def restore(self, state: Any, meta_state: Any, config: ReferenceConfig) -> NumpyReferenceCache:
        return self.cache_cls.from_state(state, meta_state)


@dataclass(frozen=True)
class Broken:
    check: str
    adapter: BrokenAdapter
    match: str
    vector: str | None = "lowrank_r8_f32"

    @property
    def id(self) -> str:
        return f"{self.check}-{self.adapter.cache_cls.__name__}"


def _broken(check, cache_cls, match, vector="lowrank_r8_f32", **adapter_kwargs) -> Broken:
    if not CHECKS[check].per_vector:
        vector = None
    return Broken(check, BrokenAdapter(cache_cls=cache_cls, **adapter_kwargs), match, vector)


BROKEN: list[Broken] = [
    _broken("protocol", NotTrimmableClaim, r"is_trimmable\(\) returns False"),
    _broken("protocol", NonStringMeta, "meta_state must hold only strings"),
    _broken("bad_input", GrowsBeforeValidating, "changed the cache: nbytes changed"),
    _broken("bad_input", WrongErrorType, "raised ValueError.* instead of KVShapeError"),
    _broken("bad_input", RestartsOnNewShape, "B changed mid-stream: was accepted; expected KVShapeError"),
    _broken(
        "rejects_nonfinite",
        NumpyReferenceCache,
        "NaN in keys: was accepted; expected KVValueError",
        config=ReferenceConfig(reject_nonfinite=False),
    ),
    _broken("rejects_nonfinite", WritesBeforeRejectingNaN, "changed the cache: offset changed"),
    _broken(
        "compresses",
        NumpyReferenceCache,
        "declares compresses=True but holds",
        capabilities=Capabilities(lossless=True, bitwise_lossless=True, compresses=True),
    ),
    _broken(
        "shape_dtype", UpcastsOutput, "output dtype float32, expected the input dtype float16", "gaussian_f16"
    ),
    _broken("shape_dtype", ReturnsOnlyNewTokens, r"step 1: keys output shape \(1, 2, 1, 64\)"),
    _broken("offset_accounting", OffsetOffByOne, r"offset \d+, expected \d+"),
    _broken(
        "causal_stability", RequantizesThePast, "earlier keys changed", capabilities=LOSSY, tolerance=0.01
    ),
    _broken("lossless", StoresFloat16, "keys are not bitwise equal to the input"),
    _broken(
        "lossless",
        StoresBfloat16,
        "keys differ from the input beyond float32 rounding",
        capabilities=Capabilities(lossless=True),
    ),
    _broken(
        "reconstruction_error",
        ScalesByOnePercent,
        r"keys relative Frobenius error 1\.00\d+e-02 exceeds the tolerance 1\.0000e-03",
        "gaussian_f32",
        capabilities=LOSSY,
        tolerance=1e-3,
    ),
    _broken(
        "reconstruction_error",
        CorruptsOneToken,
        "after the prefill.*keys relative Frobenius error",
        "randwalk_f32",
        capabilities=LOSSY,
        tolerance=0.05,
    ),
    _broken("byte_honesty", LiesAboutNbytes, "nbytes reports .* but the arrays held sum to"),
    _broken(
        "byte_honesty", RawNbytesKeysOnly, r"raw_nbytes reports \d+; B\*H\*offset\*\(D\+Dv\)\*itemsize is"
    ),
    _broken(
        "determinism",
        Nondeterministic,
        "two identical runs differ in keys",
        capabilities=LOSSY,
        tolerance=1e-3,
    ),
    _broken("trim", TrimDropsOneLess, r"after trim\(5\): offset 252, expected 251"),
    _broken("trim", TrimDoesNotClamp, r"trim\(263\) at offset 256 returned 263; it must clamp to 256"),
    _broken("trim", TrimAcceptsNegative, r"trim\(-1\): was accepted; expected KVTrimError"),
    _broken("trim", TrimKeepsStaleBytes, r"after trim\(5\): raw_nbytes"),
    _broken("serialization", LossyStateRoundTrip, "restored keys differ from the original's"),
    _broken("serialization", RestoreForgetsLastToken, "restored offset"),
    _broken("serialization", RestoreForgetsStep, "restored cache reports nbytes"),
]


# =========================================================================== tests
@pytest.mark.parametrize("broken", BROKEN, ids=[b.id for b in BROKEN])
def test_each_check_catches_its_broken_cache(broken: Broken):
    case = broken.adapter.configs()[0]
    vector = get_vector(broken.vector) if broken.vector else None
    check = CHECKS[broken.check]
    assert check.applies(case.capabilities)
    with pytest.raises(ConformanceError, match=broken.match):
        check.function(broken.adapter, case, vector)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_check_has_a_broken_cache(name):
    assert any(b.check == name for b in BROKEN), f"no broken cache proves check {name!r} can fail"


@pytest.mark.parametrize("adapter", GOOD_ADAPTERS, ids=[a.name for a in GOOD_ADAPTERS])
def test_good_caches_pass_every_applicable_check(adapter):
    failures = []
    for item in conformance_items(adapter):
        try:
            assert item.run() == PASSED, item.id
        except ConformanceError as exc:
            failures.append(str(exc))
    assert failures == []


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_check_is_passed_by_a_good_cache(name):
    items = [item for a in GOOD_ADAPTERS for item in conformance_items(a) if item.check.name == name]
    assert items, f"no good cache exercises check {name!r}"
    for item in items:
        assert item.run() == PASSED, item.id


def test_broken_adapters_pass_the_checks_they_do_not_target():
    """A broken cache is caught by its own check and not by unrelated ones that test a
    different behaviour: e.g. an nbytes liar still has correct outputs."""
    adapter = BrokenAdapter(cache_cls=LiesAboutNbytes)
    case = adapter.configs()[0]
    vector = get_vector("gaussian_f32")
    for name in ("shape_dtype", "offset_accounting", "causal_stability", "lossless", "determinism"):
        assert CHECKS[name].function(adapter, case, vector) == PASSED


CAPABILITY_OF = {
    "rejects_nonfinite": "rejects_nonfinite",
    "compresses": "compresses",
    "causal_stability": "causal_stable",
    "lossless": "lossless",
    "determinism": "deterministic",
    "trim": "trimmable",
    "serialization": "serializable",
}


@pytest.mark.parametrize("name", sorted(CAPABILITY_OF))
def test_checks_report_not_applicable_without_their_capability(name):
    flag = CAPABILITY_OF[name]
    off = {flag: False}
    if flag == "lossless":
        off["bitwise_lossless"] = False
    caps = replace(Capabilities(lossless=True, bitwise_lossless=True, compresses=True), **off)
    adapter = BrokenAdapter(capabilities=caps)
    case = adapter.configs()[0]
    check = CHECKS[name]
    assert not check.applies(caps)
    vector = get_vector("gaussian_f32") if check.per_vector else None
    assert check.function(adapter, case, vector) == NOT_APPLICABLE
    assert name not in {item.check.name for item in conformance_items(adapter)}


def test_items_use_only_accepted_dtypes_and_readable_ids():
    adapter = ReferenceAdapter()
    items = conformance_items(adapter)
    ids = [item.id for item in items]
    assert len(ids) == len(set(ids))
    assert "reference-raw-lowrank_r8_f32-trim" in ids
    assert "reference-raw-config-bad_input" in ids
    assert not any("bf16" in i for i in ids)  # the reference takes no bfloat16
    bf16 = get_vector("gaussian_bf16")
    assert CHECKS["shape_dtype"].function(adapter, adapter.configs()[0], bf16) == NOT_APPLICABLE
    per_vector = {item.vector.name for item in items if item.vector is not None}
    assert per_vector == {v.name for v in load_vectors() if v.dtype in adapter.dtypes}
