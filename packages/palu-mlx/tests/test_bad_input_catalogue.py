"""The bad-input catalogue : every named bad input to palu-mlx's public functions,
constructors and loaders raises the library's own error (a KVSpecError that is also a
ValueError or TypeError), with a message naming the problem, and leaves its subject exactly
as it was: the cache (offset, meta_state, every state byte, nbytes, next output), the model,
the file, or the arrays it was given."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kvspec
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from cache_snapshots import array_bytes, build, kv, snapshot, synthetic_calibration
from palu_helpers import make_tiny_qwen3
from palu_mlx import (
    FixedSplitPolicy,
    KVCacheBuilder,
    KVCacheConfig,
    MixedBitCoder,
    NaiveQuantKVCache,
    PaluKVCache,
    Segment,
    UniformPolicy,
    WaterFillingPolicy,
    calibrate,
    fit_group_projection,
    load_prompt_cache,
    naive_roundtrip,
    project,
    save_prompt_cache,
    select_rank,
    water_fill,
)
from palu_mlx.calibrated import CalibratedKVCache
from palu_mlx.calibration import kv_weights_digest, model_identity
from palu_mlx.cli import main as cli_main
from palu_mlx.kvspec_adapter import PaluAdapter
from palu_mlx.layer import CacheLayer
from palu_mlx.mixed_bit import pack_codes, unpack_codes


@dataclass(frozen=True)
class Bad:
    subject: Callable[[], Any]  # builds the object the call must leave unchanged
    call: Callable[[Any], Any]
    error: type[kvspec.KVSpecError]
    match: str  # the message names the problem


def observe(subject: Any) -> Any:
    """Everything observable about a subject, exactly."""
    if isinstance(subject, CacheLayer):
        return snapshot(subject)
    if isinstance(subject, mx.array):
        return array_bytes(subject)
    if isinstance(subject, np.ndarray):
        return subject.tobytes(), subject.shape
    if isinstance(subject, KVCacheConfig):
        return dataclasses.asdict(subject)
    if isinstance(subject, nn.Module):
        module = sys.modules[type(subject).__module__]
        return vars(subject).get("make_cache"), getattr(module, "scaled_dot_product_attention", None)
    if isinstance(subject, FileSubject):
        return open(subject.path, "rb").read()
    raise TypeError(f"no observer for {type(subject).__name__}")


@dataclass(frozen=True)
class FileSubject:
    path: str


# ----------------------------------------------------------------------------- tampering helpers
def with_runtime(cache, **changes) -> tuple[str, str]:
    settings, runtime = cache.meta_state
    runtime = json.loads(runtime)
    runtime.update(changes)
    return settings, json.dumps(runtime)


def with_settings(cache, **changes) -> tuple[str, str]:
    settings, runtime = cache.meta_state
    settings = json.loads(settings)
    settings.update(changes)
    return json.dumps(settings), runtime


def without(cache, settings: tuple[str, ...] = (), runtime: tuple[str, ...] = ()) -> tuple[str, str]:
    """meta_state with the named settings and runtime fields dropped."""
    parts = [json.loads(text) for text in cache.meta_state]
    for part, names in zip(parts, (settings, runtime), strict=True):
        for name in names:
            del part[name]
    return json.dumps(parts[0]), json.dumps(parts[1])


def restore(cache, state=None, meta=None, **kw):
    return type(cache).from_state(cache.state if state is None else state, meta or cache.meta_state, **kw)


def state_with(cache, **changes) -> dict[str, Any]:
    state = dict(cache.state)
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            state.pop(name)
        else:
            state[name] = value(state.get(name))
    return state


def k1(dtype=mx.float32):
    return kv(1, 3, dtype)


TINY = None


def tiny_model():
    global TINY
    if TINY is None:
        TINY = make_tiny_qwen3()
    return TINY


class FakeTokenizer:
    def encode(self, text):
        return [1, 2, 3]


def saved_file(tmp_dir) -> FileSubject:
    path = f"{tmp_dir}/catalogue.safetensors"
    save_prompt_cache(path, [build("palu-fitted")])
    return FileSubject(path)


FITTED, NAIVE, CALIB, EXACT, FIXED, ROPE = (
    "palu-fitted",
    "naive",
    "calibrated",
    "palu-exact",
    "palu-fixed",
    "palu-pre-rope",
)


def cache(kind):
    return lambda: build(kind)


CATALOGUE: dict[str, Bad] = {
    # ---- update_and_fetch
    "update: keys a list": Bad(
        cache(FITTED), lambda c: c.update_and_fetch([1.0], k1()[1]), kvspec.KVDtypeError, "mlx.core.array"
    ),
    "update: 3-D keys": Bad(
        cache(NAIVE), lambda c: c.update_and_fetch(k1()[0][0], k1()[1][0]), kvspec.KVShapeError, "4-D"
    ),
    "update: keys and values disagree on S": Bad(
        cache(FITTED),
        lambda c: c.update_and_fetch(kv(2, 1)[0], k1()[1]),
        kvspec.KVShapeError,
        "agree on B, H and S",
    ),
    "update: int32 keys": Bad(
        cache(EXACT),
        lambda c: c.update_and_fetch(*(x.astype(mx.int32) for x in k1())),
        kvspec.KVDtypeError,
        "int32 is not supported",
    ),
    "update: dtype differs from the cache's": Bad(
        cache(FITTED),
        lambda c: c.update_and_fetch(*k1(mx.float16)),
        kvspec.KVDtypeError,
        "differs from the cache's dtype",
    ),
    "update: head dim changed": Bad(
        cache(CALIB),
        lambda c: c.update_and_fetch(mx.zeros((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64))),
        kvspec.KVShapeError,
        "fixed by the first update",
    ),
    "update: NaN keys": Bad(
        cache(FITTED),
        lambda c: c.update_and_fetch(k1()[0] * float("nan"), k1()[1]),
        kvspec.KVValueError,
        "NaN",
    ),
    "update: infinite values (naive)": Bad(
        cache(NAIVE),
        lambda c: c.update_and_fetch(k1()[0], k1()[1] * float("inf")),
        kvspec.KVValueError,
        "infinity",
    ),
    "update: latents beyond float16 scales": Bad(
        cache(FITTED), lambda c: c.update_and_fetch(k1()[0], k1()[1] * 1e6), kvspec.KVValueError, "65504"
    ),
    # ---- trim
    "trim: negative": Bad(cache(FITTED), lambda c: c.trim(-1), kvspec.KVTrimError, "n=-1"),
    "trim: fractional": Bad(cache(NAIVE), lambda c: c.trim(1.5), kvspec.KVTrimError, "n=1.5"),
    "trim: bool": Bad(cache(CALIB), lambda c: c.trim(True), kvspec.KVTrimError, "n=True"),
    # ---- make_mask (called by mlx-lm's models)
    "make_mask: zero queries": Bad(cache(FITTED), lambda c: c.make_mask(0), kvspec.KVShapeError, "N=0"),
    "make_mask: window of 0": Bad(
        cache(NAIVE), lambda c: c.make_mask(2, window_size=0), kvspec.KVConfigError, "window_size=0"
    ),
    "make_mask: return_array 'yes'": Bad(
        cache(CALIB), lambda c: c.make_mask(2, return_array="yes"), kvspec.KVConfigError, "return_array='yes'"
    ),
    # ---- from_state: metadata
    "from_state: offset past the data": Bad(
        cache(FITTED),
        lambda c: restore(c, meta=with_runtime(c, offset=c.offset + 4)),
        kvspec.KVDataError,
        "has shape",
    ),
    "from_state: negative offset": Bad(
        cache(NAIVE), lambda c: restore(c, meta=with_runtime(c, offset=-1)), kvspec.KVDataError, "offset=-1"
    ),
    "from_state: fractional offset": Bad(
        cache(CALIB), lambda c: restore(c, meta=with_runtime(c, offset=2.5)), kvspec.KVDataError, "offset=2.5"
    ),
    "from_state: bool offset": Bad(
        cache(EXACT),
        lambda c: restore(c, meta=with_runtime(c, offset=True)),
        kvspec.KVDataError,
        "offset=True",
    ),
    "from_state: shape of three dims": Bad(
        cache(FITTED),
        lambda c: restore(c, meta=with_runtime(c, shape=[1, 2, 32])),
        kvspec.KVDataError,
        "shape=.*four",
    ),
    "from_state: unsupported dtype": Bad(
        cache(NAIVE),
        lambda c: restore(c, meta=with_runtime(c, dtype="float64")),
        kvspec.KVDataError,
        "dtype='float64'",
    ),
    "from_state: another class's meta_state": Bad(
        cache(NAIVE),
        lambda c: PaluKVCache.from_state(c.state, c.meta_state),
        kvspec.KVDataError,
        "written by class 'NaiveQuantKVCache'",
    ),
    "from_state: non-contiguous segments": Bad(
        cache(FITTED),
        lambda c: restore(c, meta=with_runtime(c, key_segments=[[0, 2, 4], [3, 8, 2]])),
        kvspec.KVDataError,
        "key_segments.*contiguous",
    ),
    "from_state: segment of 9 bits": Bad(
        cache(FITTED),
        lambda c: restore(c, meta=with_runtime(c, value_segments=[[0, 8, 9]])),
        kvspec.KVDataError,
        "bits one of",
    ),
    "from_state: fixed width 0": Bad(
        cache(FIXED),
        lambda c: restore(c, meta=with_runtime(c, key_fixed_widths=[0, 2])),
        kvspec.KVDataError,
        r"key_fixed_widths.*ints in \[1, 8\]",
    ),
    "from_state: fixed widths disagree with segments": Bad(
        cache(FIXED),
        lambda c: restore(
            c,
            meta=with_runtime(c, key_fixed_widths=[8] * len(json.loads(c.meta_state[1])["key_fixed_widths"])),
        ),
        kvspec.KVDataError,
        "do not match",
    ),
    "from_state: segments on an unfitted cache": Bad(
        cache(EXACT),
        lambda c: restore(c, meta=with_runtime(c, key_segments=[[0, 8, 2]])),
        kvspec.KVDataError,
        "both null \\(before the fit\\) or both set",
    ),
    "from_state: empty cache with an offset": Bad(
        lambda: build("palu-empty"),
        lambda c: restore(c, meta=with_runtime(c, offset=3)),
        kvspec.KVDataError,
        "empty cache needs",
    ),
    "from_state: odd rope dims": Bad(
        cache(ROPE),
        lambda c: restore(c, meta=with_runtime(c, rope={"dims": 7, "traditional": False})),
        kvspec.KVDataError,
        "rope dims=7",
    ),
    "from_state: rope dims above the head dim": Bad(
        cache(ROPE),
        lambda c: restore(c, meta=with_runtime(c, rope={"dims": 64, "traditional": False})),
        kvspec.KVDataError,
        "key head dim 32",
    ),
    "from_state: meta_state of one item": Bad(
        cache(FITTED),
        lambda c: restore(c, meta=c.meta_state[:1]),
        kvspec.KVDataError,
        "two strings; got 1 items",
    ),
    "from_state: runtime not JSON": Bad(
        cache(CALIB),
        lambda c: restore(c, meta=(c.meta_state[0], "{offset")),
        kvspec.KVDataError,
        "not valid JSON",
    ),
    "from_state: unknown config field": Bad(
        cache(FITTED),
        lambda c: restore(c, meta=with_settings(c, palu_turbo=True)),
        kvspec.KVDataError,
        "palu_turbo",
    ),
    "from_state: check_finite 'no' in naive settings": Bad(
        cache(NAIVE),
        lambda c: restore(c, meta=with_settings(c, check_finite="no")),
        kvspec.KVDataError,
        "check_finite='no'",
    ),
    "from_state: naive settings missing a field": Bad(
        cache(NAIVE),
        lambda c: restore(c, meta=(json.dumps({"quant_bits": 2}), c.meta_state[1])),
        kvspec.KVDataError,
        "exactly quant_bits",
    ),
    "from_state: sink arrays dropped with the config field that kept them": Bad(
        cache(FITTED),
        lambda c: restore(
            c, state=state_with(c, sink__keys=None, sink__values=None), meta=without(c, ("palu_sink_tokens",))
        ),
        kvspec.KVDataError,
        r"config lacks the keywords \['palu_sink_tokens'\]",
    ),
    "from_state: palu_group_size changed after the fit (fixed quantizers)": Bad(
        cache(FIXED),
        lambda c: restore(c, meta=with_settings(c, palu_group_size=7)),
        kvspec.KVDataError,
        r"palu_group_size=7, but the state's codes were made with palu_group_size=32; allowed: 32",
    ),
    "from_state: palu_group_size changed after the fit (same group count)": Bad(
        cache(FITTED),
        lambda c: restore(c, meta=with_settings(c, palu_group_size=33)),
        kvspec.KVDataError,
        "palu_group_size=33, but the state's codes were made with palu_group_size=32",
    ),
    "from_state: palu_hi_bit changed after the fit": Bad(
        cache(FITTED),
        lambda c: restore(c, meta=with_settings(c, palu_hi_bit=8)),
        kvspec.KVDataError,
        "palu_hi_bit=8, but the state's codes were made with palu_hi_bit=4",
    ),
    "from_state: coded_with missing after the fit": Bad(
        cache(FIXED),
        lambda c: restore(c, meta=without(c, runtime=("coded_with",))),
        kvspec.KVDataError,
        "'coded_with'",
    ),
    "from_state: coded_with before the fit": Bad(
        cache(EXACT),
        lambda c: restore(c, meta=with_runtime(c, coded_with={"palu_bits": 2.0})),
        kvspec.KVDataError,
        "coded_with=.*must be null before the fit",
    ),
    # ---- from_state: arrays
    "from_state: state not a dict": Bad(
        cache(FITTED),
        lambda c: restore(c, state=list(c.state.values())),
        kvspec.KVDataError,
        "state must be a dict",
    ),
    "from_state: numpy array in state": Bad(
        cache(NAIVE),
        lambda c: restore(c, state=state_with(c, key__codes=lambda a: np.array(a))),
        kvspec.KVDataError,
        "'key.codes' must map",
    ),
    "from_state: missing array": Bad(
        cache(FITTED),
        lambda c: restore(c, state=state_with(c, key__basis=None)),
        kvspec.KVDataError,
        "missing array 'key.basis'",
    ),
    "from_state: extra array": Bad(
        cache(CALIB),
        lambda c: restore(c, state=state_with(c, extra=lambda _: mx.zeros(1))),
        kvspec.KVDataError,
        r"\['extra'\].*does not describe",
    ),
    "from_state: array of the wrong dtype": Bad(
        cache(FITTED),
        lambda c: restore(c, state=state_with(c, key__mean=lambda a: a.astype(mx.float32))),
        kvspec.KVDataError,
        "'key.mean' has dtype float32",
    ),
    "from_state: array of the wrong shape": Bad(
        cache(EXACT),
        lambda c: restore(c, state=state_with(c, exact_values=lambda a: a[..., :16])),
        kvspec.KVDataError,
        "'exact_values' has shape",
    ),
    "from_state: NaN in an array": Bad(
        cache(NAIVE),
        lambda c: restore(c, state=state_with(c, value__scales=lambda a: a * float("nan"))),
        kvspec.KVDataError,
        "'value.scales'.*NaN",
    ),
    "from_state: zero quantizer steps": Bad(
        cache(CALIB),
        lambda c: restore(c, state=state_with(c, key__steps=lambda a: a * 0)),
        kvspec.KVDataError,
        "'key.steps'.*> 0",
    ),
    "from_state: calibrated widths longer than the steps": Bad(
        cache(CALIB),
        lambda c: restore(
            c, meta=with_runtime(c, key_widths=[*json.loads(c.meta_state[1])["key_widths"], 1])
        ),
        kvspec.KVDataError,
        "'key.basis' has shape",
    ),
    "from_state: allocation_policy not a policy": Bad(
        cache(FITTED), lambda c: restore(c, allocation_policy=5), kvspec.KVConfigError, "allocation_policy"
    ),
    # ---- constructors and configuration
    "config: check_finite 'no'": Bad(
        KVCacheConfig,
        lambda c: dataclasses.replace(c, palu_check_finite="no"),
        kvspec.KVConfigError,
        "palu_check_finite='no'",
    ),
    "config: check_finite 1": Bad(
        KVCacheConfig,
        lambda c: dataclasses.replace(c, palu_check_finite=1),
        kvspec.KVConfigError,
        "palu_check_finite=1",
    ),
    "config: from_json of broken JSON": Bad(
        KVCacheConfig,
        lambda c: KVCacheConfig.from_json(c.to_json()[:-2]),
        kvspec.KVConfigError,
        "not valid JSON",
    ),
    "naive: check_finite 'yes'": Bad(
        cache(NAIVE),
        lambda c: NaiveQuantKVCache(2, 32, check_finite="yes"),
        kvspec.KVConfigError,
        "check_finite='yes'",
    ),
    "naive: quant_bits 2.0": Bad(
        cache(NAIVE), lambda c: NaiveQuantKVCache(2.0, 32), kvspec.KVConfigError, "quant_bits=2.0"
    ),
    "naive_roundtrip: D not a multiple of the group": Bad(
        lambda: mx.ones((2, 48)),
        lambda x: naive_roundtrip(x, 2, 32),
        kvspec.KVShapeError,
        "multiple of group_size=32",
    ),
    "policy: hi_fraction 2.0": Bad(
        KVCacheConfig,
        lambda c: FixedSplitPolicy(4, 2, 2.0),
        kvspec.KVConfigError,
        r"hi_fraction=2.0.*\[0, 1\]",
    ),
    "policy: hi_bit 9": Bad(
        KVCacheConfig, lambda c: FixedSplitPolicy(9, 2, 0.25), kvspec.KVConfigError, "hi_bit=9"
    ),
    "policy: uniform 0 bits": Bad(KVCacheConfig, lambda c: UniformPolicy(0), kvspec.KVConfigError, "bits=0"),
    "policy: water-filling max_bits 9": Bad(
        KVCacheConfig, lambda c: WaterFillingPolicy(2.0, max_bits=9), kvspec.KVConfigError, "max_bits=9"
    ),
    "policy: NaN singular values": Bad(
        lambda: np.array([[1.0, np.nan]]),
        lambda sv: FixedSplitPolicy(4, 2, 0.5).allocate(sv),
        kvspec.KVConfigError,
        "NaN",
    ),
    "segment: stop before start": Bad(
        KVCacheConfig, lambda c: Segment(3, 1, 2), kvspec.KVConfigError, "start <= stop"
    ),
    "water_fill: NaN variance": Bad(
        lambda: np.array([1.0, np.nan]),
        lambda v: water_fill([v], 4),
        kvspec.KVConfigError,
        r"variances\[0\].*NaN",
    ),
    "segment: float start": Bad(
        KVCacheConfig, lambda c: Segment(0.5, 2, 2), kvspec.KVConfigError, "must be ints"
    ),
    "cli main: argv a string": Bad(
        KVCacheConfig, lambda c: cli_main("calibrate"), kvspec.KVConfigError, "argv='calibrate'"
    ),
    "conformance adapter: text as an array": Bad(
        KVCacheConfig,
        lambda c: PaluAdapter().to_native("keys", "float32"),
        kvspec.KVDtypeError,
        "numeric array; got str",
    ),
    "coder: group_size 0": Bad(
        KVCacheConfig,
        lambda c: MixedBitCoder((Segment(0, 4, 2),), 0, mx.float16),
        kvspec.KVConfigError,
        "group_size=0",
    ),
    "coder: latents of another rank": Bad(
        lambda: mx.ones((1, 5)),
        lambda x: MixedBitCoder((Segment(0, 4, 2),), 4, mx.float16).encode(x),
        kvspec.KVShapeError,
        "5 channels; coder rank is 4",
    ),
    "pack_codes: code wider than its bits": Bad(
        lambda: mx.array([1, 4, 0], dtype=mx.uint32),
        lambda codes: pack_codes(codes, 2),
        kvspec.KVValueError,
        r"\[0, 4\].*2-bit.*neighbour",
    ),
    "pack_codes: negative code": Bad(
        lambda: mx.array([1, -1], dtype=mx.int32),
        lambda codes: pack_codes(codes, 3),
        kvspec.KVValueError,
        r"\[-1, 1\]",
    ),
    "pack_codes: float codes": Bad(
        lambda: mx.array([0.5, 1.0]), lambda codes: pack_codes(codes, 2), kvspec.KVDtypeError, "integer array"
    ),
    "pack_codes: 9 bits": Bad(
        lambda: mx.array([1], dtype=mx.uint32),
        lambda codes: pack_codes(codes, 9),
        kvspec.KVConfigError,
        "bits=9",
    ),
    "unpack_codes: more codes than the words hold": Bad(
        lambda: mx.array([3], dtype=mx.uint8),
        lambda w: unpack_codes(w, 2, 5),
        kvspec.KVShapeError,
        r"n=5.*\[0, 4\]",
    ),
    "fit_group_projection: rank 0": Bad(
        lambda: mx.ones((1, 2, 4, 8)),
        lambda x: fit_group_projection(x, 1, 0),
        kvspec.KVConfigError,
        "palu_rank=0",
    ),
    "project: head dim differs from the projection's": Bad(
        lambda: mx.ones((1, 2, 4, 8)),
        lambda x: project(x, fit_group_projection(mx.ones((1, 2, 4, 16)), 1, 2)),
        kvspec.KVShapeError,
        "head dim 8; the projection's is 16",
    ),
    "select_rank: threshold 0": Bad(
        lambda: np.ones((1, 4)), lambda sv: select_rank(sv, 0.0), kvspec.KVConfigError, "energy_threshold=0.0"
    ),
    # ---- builder, files, calibration
    "for_model: None as model": Bad(
        KVCacheConfig,
        lambda c: KVCacheBuilder.for_model(None, c),
        kvspec.KVConfigError,
        "model must be an mlx-lm model",
    ),
    "for_model: config a dict": Bad(
        tiny_model,
        lambda m: KVCacheBuilder.for_model(m, {"head_dim": 32}),
        kvspec.KVConfigError,
        "config must be a KVCacheConfig",
    ),
    "for_model: allocation_policy a string": Bad(
        tiny_model,
        lambda m: KVCacheBuilder.for_model(m, KVCacheConfig(head_dim=32), "4bit"),
        kvspec.KVConfigError,
        "allocation_policy",
    ),
    "install: not a model": Bad(
        KVCacheConfig, lambda c: KVCacheBuilder.install(object(), c), kvspec.KVConfigError, "got object"
    ),
    "install: config of another head dim": Bad(
        tiny_model,
        lambda m: KVCacheBuilder.install(m, KVCacheConfig(head_dim=64)),
        kvspec.KVConfigError,
        "head_dim=64",
    ),
    "uninstall: a string": Bad(
        KVCacheConfig,
        lambda c: KVCacheBuilder.uninstall("model"),
        kvspec.KVConfigError,
        "model must be an mlx-lm model",
    ),
    "install: a module without layers": Bad(
        KVCacheConfig,
        lambda c: KVCacheBuilder.install(nn.Linear(2, 2), c),
        kvspec.KVConfigError,
        "neither a list of .layers",
    ),
    "save_prompt_cache: cache a string": Bad(
        lambda: saved_file(PATHS[0]),
        lambda f: save_prompt_cache(f.path, "caches"),
        kvspec.KVConfigError,
        "cache must be a list",
    ),
    "save_prompt_cache: metadata not str -> str": Bad(
        lambda: saved_file(PATHS[0]),
        lambda f: save_prompt_cache(f.path, [build(NAIVE)], {"n": 3}),
        kvspec.KVConfigError,
        "metadata must be None or a dict of str -> str",
    ),
    "save_prompt_cache: a layer that is not a cache": Bad(
        lambda: saved_file(PATHS[0]),
        lambda f: save_prompt_cache(f.path, [build(NAIVE), object()]),
        kvspec.KVConfigError,
        "layer 1: cannot save a object",
    ),
    "load_prompt_cache: return_metadata 'yes'": Bad(
        lambda: saved_file(PATHS[0]),
        lambda f: load_prompt_cache(f.path, return_metadata="yes"),
        kvspec.KVConfigError,
        "return_metadata='yes'",
    ),
    "load_prompt_cache: file_name None": Bad(
        lambda: saved_file(PATHS[0]),
        lambda f: load_prompt_cache(None),
        kvspec.KVConfigError,
        "file_name=None",
    ),
    "calibrate: not a model": Bad(
        KVCacheConfig,
        lambda c: calibrate(object(), FakeTokenizer()),
        kvspec.KVConfigError,
        "model must be an mlx-lm model",
    ),
    "calibrate: max_tokens 0": Bad(
        tiny_model,
        lambda m: calibrate(m, FakeTokenizer(), max_tokens=0),
        kvspec.KVConfigError,
        "max_tokens=0",
    ),
    "calibration check_model: None": Bad(
        KVCacheConfig,
        lambda c: synthetic_calibration().check_model(None),
        kvspec.KVConfigError,
        "model must be",
    ),
    "model_identity: not a model": Bad(
        KVCacheConfig,
        lambda c: model_identity("qwen3"),
        kvspec.KVConfigError,
        "model must be an mlx-lm model",
    ),
    "kv_weights_digest: not a model": Bad(
        KVCacheConfig, lambda c: kv_weights_digest(3), kvspec.KVConfigError, "model must be an mlx-lm model"
    ),
    "calibrated from_state: key and value head counts differ": Bad(
        lambda: build("calibrated-empty"),
        lambda c: CalibratedKVCache.from_state(
            state_with(c, **{f"value__{n}": (lambda a: a[:1]) for n in ("basis", "mean", "steps")}),
            c.meta_state,
        ),
        kvspec.KVDataError,
        "2 heads but value.basis 1",
    ),
    "calibrated from_state: widths of 9 bits": Bad(
        cache(CALIB),
        lambda c: CalibratedKVCache.from_state(c.state, with_runtime(c, value_widths=[9])),
        kvspec.KVDataError,
        r"value_widths=\[9\]",
    ),
}

PATHS: list[str] = []


def test_catalogue_is_large_enough():
    assert len(CATALOGUE) >= 40


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_bad_input(name, tmp_path):
    PATHS[:] = [str(tmp_path)]
    bad = CATALOGUE[name]
    subject = bad.subject()
    before = observe(subject)
    with pytest.raises(bad.error, match=bad.match) as info:
        bad.call(subject)
    # the library's own error, and a builtin a generic caller can catch
    assert isinstance(info.value, kvspec.KVSpecError) and isinstance(info.value, (ValueError, TypeError))
    assert observe(subject) == before
