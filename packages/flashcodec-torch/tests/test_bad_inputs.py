"""The bad-input catalogue: every named bad input raises the library's own error (a ``KVSpecError``
that is also a ``ValueError`` or ``TypeError``) whose message names the problem, and leaves the object
it was given to exactly as it was (a bitwise snapshot of every buffer, view and layer, compared
before and after; files compared byte for byte).

Each entry: ``name -> (target, call, error class, message pattern)``. ``target(ctx)`` builds the
object the call acts on (None for a constructor or a pure function, which has no object to change);
``call(obj, ctx)`` makes the bad call. ``ctx`` carries a temporary directory and a tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import kvspec
import pytest
import torch
from conftest import random_walk
from flashcodec import CodecKVCache, CodecStorage, JPEGCodec, PNGCodec, dct_matrix, delta_variance_ratio, tier
from flashcodec.attention import codec_decode_attention
from flashcodec.codecs import MixedJPEGCodec, make_codec
from flashcodec.codecs.quant import pack_int4
from flashcodec.stream import CodecStream
from snapshots import snapshot

pytest.importorskip("transformers")
from flashcodec.hf import (  # noqa: E402
    Calibration,
    FlashCodecCache,
    FlashCodecLayer,
    apply_codec_attention,
    apply_flash_codec,
    remove_codec_attention,
    remove_flash_codec,
)
from test_hf_patch import tiny_qwen3  # noqa: E402


# ------------------------------------------------------------------ targets
def filled(codec=None, dtype=torch.float32, s=13) -> CodecKVCache:
    cache = CodecKVCache(codec=codec or PNGCodec(8, keep_ratio=1.0))
    x = random_walk(s=s, dtype=dtype)
    cache.update_and_fetch(x, -x)
    cache.read()
    return cache


def filled_hf() -> FlashCodecCache:
    cache = FlashCodecCache(codec=PNGCodec(4))
    x = random_walk(b=3, s=10)
    cache.update(x, x, 0)
    return cache


def good(b=2, s=3, dtype=torch.float32) -> torch.Tensor:
    return random_walk(b=b, s=s, seed=5, dtype=dtype)


def with_meta(cache: CodecKVCache, **changes) -> tuple[str, ...]:
    """``cache.meta_state`` with some ``key=value`` entries replaced."""
    items = dict(m.split("=", 1) for m in cache.meta_state)
    items.update({k: str(v) for k, v in changes.items()})
    return tuple(f"{k}={v}" for k, v in items.items())


def with_array(cache: CodecKVCache, index: int, edit) -> list[torch.Tensor]:
    state = list(cache.state)
    state[index] = edit(state[index])
    return state


def _set(t: torch.Tensor, value) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = value
    return t


def calibration_file(ctx) -> Path:
    path = ctx.tmp / "schedule.json"
    Calibration(schedule={0: "png"}, candidates={"png": PNGCodec(8)}, budget=1.0, ratio=1.0).save(path)
    return path


def corrupt_json(ctx) -> Path:
    path = calibration_file(ctx)
    path.write_text(path.read_text()[:-20])
    return path


def tampered(ctx) -> Path:
    path = calibration_file(ctx)
    doc = json.loads(path.read_text())
    doc["calibration"]["budget"] = 0.5
    path.write_text(json.dumps(doc))
    return path


def model(ctx):
    return ctx.model


# ------------------------------------------------------------------ the catalogue
_KV = {"initial_blocks": 1}

CATALOGUE = {
    # constructors and pure functions (no object to change)
    "cache-check-finite-string": (
        None,
        lambda o, c: CodecKVCache(check_finite="no"),
        kvspec.KVConfigError,
        "check_finite must be True or False; got 'no'",
    ),
    "cache-check-finite-int": (
        None,
        lambda o, c: CodecKVCache(check_finite=1),
        kvspec.KVConfigError,
        "check_finite must be True or False; got 1",
    ),
    "cache-initial-blocks-zero": (
        None,
        lambda o, c: CodecKVCache(initial_blocks=0),
        kvspec.KVConfigError,
        "initial_blocks must be an integer >= 1",
    ),
    "cache-initial-blocks-bool": (
        None,
        lambda o, c: CodecKVCache(initial_blocks=True),
        kvspec.KVConfigError,
        "initial_blocks must be an integer >= 1; got True",
    ),
    "cache-codec-and-keyword": (
        None,
        lambda o, c: CodecKVCache(codec=PNGCodec(), block_size=4),
        kvspec.KVConfigError,
        "not both",
    ),
    "cache-codec-not-a-codec": (
        None,
        lambda o, c: CodecKVCache(codec="png"),
        kvspec.KVConfigError,
        "codec must be a codec object",
    ),
    "cache-unknown-mode": (
        None,
        lambda o, c: CodecKVCache(mode="gif"),
        kvspec.KVConfigError,
        "mode must be one of",
    ),
    "jpeg-keep-freqs-above-r": (
        None,
        lambda o, c: JPEGCodec(8, keep_freqs=9),
        kvspec.KVConfigError,
        "keep_freqs must be an integer in 1..block_size=8; got 9",
    ),
    "jpeg-quant-bits-6": (
        None,
        lambda o, c: JPEGCodec(8, quant_bits=6),
        kvspec.KVConfigError,
        "quant_bits must be None, 8 or 4; got 6",
    ),
    "png-keep-ratio-zero": (
        None,
        lambda o, c: PNGCodec(8, keep_ratio=0.0),
        kvspec.KVConfigError,
        r"keep_ratio must be a number in \(0, 1\]",
    ),
    "png-delta-dtype-fp16": (
        None,
        lambda o, c: PNGCodec(8, delta_dtype=torch.float16),
        kvspec.KVConfigError,
        "delta_dtype must be",
    ),
    "block-size-zero": (
        None,
        lambda o, c: JPEGCodec(0),
        kvspec.KVConfigError,
        "block_size must be an integer >= 1; got 0",
    ),
    "mixed-freq-bits-3": (
        None,
        lambda o, c: MixedJPEGCodec(2, freq_bits=(8, 3)),
        kvspec.KVConfigError,
        "freq_bits must be 2 values",
    ),
    "make-codec-other-modes-option": (
        None,
        lambda o, c: make_codec("jpeg", keep_ratio=0.5),
        kvspec.KVConfigError,
        "keep_ratio applies to mode='png' only",
    ),
    "dct-keep-freqs-12-of-8": (
        None,
        lambda o, c: dct_matrix(8, keep_freqs=12),
        kvspec.KVConfigError,
        "keep_freqs must be an integer in 1..8; got 12",
    ),
    "dct-integer-dtype": (
        None,
        lambda o, c: dct_matrix(8, dtype=torch.int32),
        kvspec.KVConfigError,
        "dtype must be a floating torch.dtype",
    ),
    "storage-negative-bytes": (
        None,
        lambda o, c: CodecStorage(used=-1),
        kvspec.KVConfigError,
        r"CodecStorage.used must be a byte count \(an integer >= 0\); got -1",
    ),
    "tier-unknown": (None, lambda o, c: tier("jpeg-k3"), kvspec.KVConfigError, "tier must be one of"),
    "stream-batch-zero": (
        None,
        lambda o, c: CodecStream(PNGCodec(), 0, 1, 4, torch.float32, "cpu"),
        kvspec.KVConfigError,
        "batch must be an integer >= 1; got 0",
    ),
    "codec-encode-not-a-tensor": (
        None,
        lambda o, c: JPEGCodec().encode([[1.0] * 4] * 8),
        kvspec.KVDtypeError,
        "codec input must be a floating-point torch.Tensor",
    ),
    "codec-encode-partial-block": (
        None,
        lambda o, c: JPEGCodec().encode(torch.zeros(1, 1, 7, 4)),
        kvspec.KVShapeError,
        "must be a multiple of block_size=8",
    ),
    "codec-decode-missing-part": (
        None,
        lambda o, c: JPEGCodec(8, quant_bits=8).decode(
            (torch.zeros(1, 1, 1, 8, 4, dtype=torch.int8),), torch.float32
        ),
        kvspec.KVShapeError,
        r"jpeg codec parts must be 2 tensor\(s\) \(coeffs, scales\)",
    ),
    "delta-variance-one-token": (
        None,
        lambda o, c: delta_variance_ratio(torch.zeros(1, 1, 1, 4)),
        kvspec.KVShapeError,
        "S >= 2",
    ),
    "pack-int4-code-too-wide": (
        None,
        lambda o, c: pack_int4(torch.tensor([3, 9])),
        kvspec.KVValueError,
        "int4 codes must be whole numbers in -8..7",
    ),
    "pack-int4-fractional-code": (
        None,
        lambda o, c: pack_int4(torch.tensor([0.5, 1.0])),
        kvspec.KVValueError,
        "int4 codes must be whole numbers",
    ),
    "png-decode-missing-delta-rows": (
        None,
        lambda o, c: PNGCodec(8).decode(
            (torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 5, 4, dtype=torch.float64)), torch.float32
        ),
        kvspec.KVShapeError,
        r"deltas \[\.\.\., n, r-1, D\] with r-1=7",
    ),
    "hf-config-not-a-config": (
        None,
        lambda o, c: FlashCodecCache(config=object()),
        kvspec.KVConfigError,
        "num_hidden_layers",
    ),
    "hf-from-config-none": (
        None,
        lambda o, c: FlashCodecCache.from_config(None),
        kvspec.KVConfigError,
        "needs a model config",
    ),
    # appends
    "update-not-a-tensor": (
        lambda c: filled(),
        lambda o, c: o.update_and_fetch(good().tolist(), good()),
        kvspec.KVDtypeError,
        "keys must be a torch.Tensor; got list",
    ),
    "update-rank-3": (
        lambda c: filled(),
        lambda o, c: o.update_and_fetch(good()[0], good()[0]),
        kvspec.KVShapeError,
        r"must be 4-D \[B, H, S, D\]",
    ),
    "update-batch-changed": (
        lambda c: filled(),
        lambda o, c: o.update_and_fetch(good(b=1), good(b=1)),
        kvspec.KVShapeError,
        "fixed by the first update",
    ),
    "update-int-dtype": (
        lambda c: filled(),
        lambda o, c: o.update_and_fetch(good().long(), good().long()),
        kvspec.KVDtypeError,
        "dtype must be one of float32, float16, bfloat16; got torch.int64",
    ),
    "update-dtype-changed": (
        lambda c: filled(),
        lambda o, c: o.update_and_fetch(good().half(), good().half()),
        kvspec.KVDtypeError,
        "dtype is fixed by the first update at torch.float32",
    ),
    "update-nan": (
        lambda c: filled(),
        lambda o, c: o.update_and_fetch(_set(good(), float("nan")), good()),
        kvspec.KVValueError,
        "keys contain NaN or infinity",
    ),
    "update-zero-length": (
        lambda c: filled(),
        lambda o, c: o.update_and_fetch(good(s=0), good(s=0)),
        kvspec.KVShapeError,
        "every dimension must be >= 1",
    ),
    "jpeg-fp16-overflow": (
        lambda c: filled(JPEGCodec(8), torch.float16),
        lambda o, c: o.update_and_fetch(
            torch.full((2, 3, 16, 16), 30000.0, dtype=torch.float16), good(s=16, dtype=torch.float16)
        ),
        kvspec.KVValueError,
        "keys: the jpeg codec's stored torch.float16 values overflow",
    ),
    "forward-bad-input-keeps-old-tokens": (
        lambda c: filled(),
        lambda o, c: o.forward(good(), good(b=1)),
        kvspec.KVShapeError,
        "must agree on B, H and S",
    ),
    # edits
    "crop-float": (
        lambda c: filled(),
        lambda o, c: o.crop(2.5),
        kvspec.KVTrimError,
        "max_length must be an integer; got 2.5",
    ),
    "trim-negative": (lambda c: filled(), lambda o, c: o.trim(-5), kvspec.KVTrimError, "-5"),
    "reorder-out-of-range": (
        lambda c: filled(),
        lambda o, c: o.reorder(torch.tensor([0, 2])),
        kvspec.KVShapeError,
        r"beam_idx entries must lie in -2..1",
    ),
    "reorder-float-indices": (
        lambda c: filled(),
        lambda o, c: o.reorder(torch.tensor([0.0, 1.0])),
        kvspec.KVShapeError,
        "beam_idx must be a 1-D integer tensor",
    ),
    "reorder-empty": (
        lambda c: filled(),
        lambda o, c: o.reorder([]),
        kvspec.KVShapeError,
        "beam_idx must select at least one batch row",
    ),
    "reorder-boolean": (
        lambda c: filled(),
        lambda o, c: o.reorder(torch.tensor([True, False])),
        kvspec.KVShapeError,
        "beam_idx must hold integer indices, not booleans",
    ),
    "reorder-string": (
        lambda c: filled(),
        lambda o, c: o.reorder("01"),
        kvspec.KVShapeError,
        "beam_idx must be a 1-D integer tensor or sequence; got str",
    ),
    "reorder-empty-cache-float": (
        lambda c: CodecKVCache(),
        lambda o, c: o.reorder([0.5]),
        kvspec.KVShapeError,
        "beam_idx must be a 1-D integer tensor",
    ),
    "hf-select-on-empty-layer-string": (
        lambda c: FlashCodecLayer(),
        lambda o, c: o.batch_select_indices("0"),
        kvspec.KVShapeError,
        "indices must be a 1-D integer tensor or sequence; got str",
    ),
    "hf-mask-sizes-negative": (
        lambda c: FlashCodecLayer(),
        lambda o, c: o.get_mask_sizes(-1),
        kvspec.KVShapeError,
        "query_length must be an integer >= 0",
    ),
    "reorder-never-filled-cache": (
        lambda c: CodecKVCache(),
        lambda o, c: o.reorder([5]),
        kvspec.KVShapeError,
        r"cannot gather batch rows \[5\] \(beam_idx\) from a cache that never stored a token",
    ),
    # attention on the stored rows (the cache whose streams it reads must not change)
    "decode-attention-every-key-masked": (
        lambda c: filled(JPEGCodec(8, quant_bits=8)),
        lambda o, c: codec_decode_attention(
            good(s=1), o.keys, o.values, key_mask=torch.tensor([[True] * 13, [False] * 13])
        ),
        kvspec.KVValueError,
        r"key_mask must leave every sequence at least one key.*batch rows \[1\] have none",
    ),
    "decode-attention-float64-query": (
        lambda c: filled(JPEGCodec(8, quant_bits=8)),
        lambda o, c: codec_decode_attention(good(s=1).double(), o.keys, o.values),
        kvspec.KVDtypeError,
        "query dtype must be one of float32, float16, bfloat16; got torch.float64",
    ),
    # from_state (the source cache is the object that must not change)
    "from-state-offset-past-the-data": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(o.state, with_meta(o, offset=99)),
        kvspec.KVDataError,
        "records offset=99",
    ),
    "from-state-negative-offset": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(o.state, with_meta(o, offset=-1)),
        kvspec.KVConfigError,
        "offset must be an integer >= 0; got -1",
    ),
    "from-state-fractional-offset": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(o.state, with_meta(o, offset=1.5)),
        kvspec.KVConfigError,
        "offset must be an integer >= 0; got 1.5",
    ),
    "from-state-block-size-edited": (
        lambda c: filled(JPEGCodec(8, keep_freqs=2)),
        lambda o, c: CodecKVCache.from_state(o.state, with_meta(o, block_size=16)),
        kvspec.KVDataError,
        "block_size=16",
    ),
    "from-state-png-block-size-edited": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(o.state, with_meta(o, block_size=4)),
        kvspec.KVDataError,
        "block_size=4",
    ),
    "from-state-wrong-dtype": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(with_array(o, 0, lambda t: t.double()), o.meta_state),
        kvspec.KVDataError,
        "part 'anchors' must be",
    ),
    "from-state-wrong-shape": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(with_array(o, 1, lambda t: t[..., :3, :]), o.meta_state),
        kvspec.KVDataError,
        "part 'deltas' must be",
    ),
    "from-state-tail-too-long": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(
            with_array(o, 2, lambda t: torch.cat([t, t, t], 2)), o.meta_state
        ),
        kvspec.KVDataError,
        "t < block_size=8",
    ),
    "from-state-nan": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(with_array(o, 1, lambda t: _set(t, float("nan"))), o.meta_state),
        kvspec.KVDataError,
        "'deltas' holds NaN or infinity",
    ),
    "from-state-negative-scale": (
        lambda c: filled(JPEGCodec(8, quant_bits=8)),
        lambda o, c: CodecKVCache.from_state(with_array(o, 1, lambda t: _set(t, -1.0)), o.meta_state),
        kvspec.KVDataError,
        "negative scale",
    ),
    "from-state-int8-code-128": (
        lambda c: filled(JPEGCodec(8, quant_bits=8)),
        lambda o, c: CodecKVCache.from_state(with_array(o, 0, lambda t: _set(t, -128)), o.meta_state),
        kvspec.KVDataError,
        "int8 code -128",
    ),
    "from-state-int4-zero-nibble": (
        lambda c: filled(JPEGCodec(8, quant_bits=4)),
        lambda o, c: CodecKVCache.from_state(with_array(o, 0, lambda t: _set(t, 0)), o.meta_state),
        kvspec.KVDataError,
        "0 nibble",
    ),
    "from-state-check-finite-yes": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(o.state, with_meta(o, check_finite="yes")),
        kvspec.KVConfigError,
        "check_finite must be True or False; got 'yes'",
    ),
    "from-state-unknown-format": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(o.state, with_meta(o, format="flashcodec-cache-9")),
        kvspec.KVConfigError,
        "meta_state format must be .flashcodec-cache-3.; got .flashcodec-cache-9.",
    ),
    "from-state-repeated-key": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(o.state, (*o.meta_state, "offset=13")),
        kvspec.KVConfigError,
        "names a key twice",
    ),
    "from-state-a-tensor": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(o.state[0], o.meta_state),
        kvspec.KVDataError,
        "state must be a sequence of tensors",
    ),
    "from-state-keys-values-disagree": (
        lambda c: filled(),
        lambda o, c: CodecKVCache.from_state(with_array(o, 5, lambda t: t[:, :, :1]), o.meta_state),
        kvspec.KVDataError,
        "keys and values state must agree",
    ),
    # transformers cache and layer
    "hf-update-float-layer-idx": (
        lambda c: filled_hf(),
        lambda o, c: o.update(good(b=3), good(b=3), 1.5),
        kvspec.KVConfigError,
        "layer_idx must be an integer >= 0; got 1.5",
    ),
    "hf-update-negative-layer-idx": (
        lambda c: filled_hf(),
        lambda o, c: o.update(good(b=3), good(b=3), -1),
        kvspec.KVConfigError,
        "layer_idx must be an integer >= 0; got -1",
    ),
    "hf-update-past-the-config": (
        lambda c: FlashCodecCache.from_config(c.model.config),
        lambda o, c: o.update(good(), good(), 4),
        kvspec.KVConfigError,
        r"layer_idx must be an integer in 0..3; got 4",
    ),
    "hf-update-bad-input-on-new-layer": (
        lambda c: filled_hf(),
        lambda o, c: o.update(good(), good(b=1), 3),
        kvspec.KVShapeError,
        "must agree on B, H and S",
    ),
    "hf-fresh-layer-bad-input": (
        lambda c: FlashCodecLayer(),
        lambda o, c: o.update(good(), good()[..., :2, :]),
        kvspec.KVShapeError,
        "must agree on B, H and S",
    ),
    "hf-fresh-layer-empty-int-step": (
        lambda c: FlashCodecLayer(),
        lambda o, c: o.update(good(s=0).long(), good(s=0).long()),
        kvspec.KVDtypeError,
        "got torch.int64",
    ),
    "hf-repeat-fractional": (
        lambda c: filled_hf(),
        lambda o, c: o.batch_repeat_interleave(2.7),
        kvspec.KVShapeError,
        "repeats must be an integer >= 1; got 2.7",
    ),
    "hf-repeat-zero": (
        lambda c: filled_hf(),
        lambda o, c: o.batch_repeat_interleave(0),
        kvspec.KVShapeError,
        "repeats must be an integer >= 1; got 0",
    ),
    "hf-select-out-of-range": (
        lambda c: filled_hf(),
        lambda o, c: o.batch_select_indices(torch.tensor([0, 3])),
        kvspec.KVShapeError,
        r"^indices entries must lie in -3..2",
    ),
    "hf-select-mask-length": (
        lambda c: filled_hf(),
        lambda o, c: o.batch_select_indices(torch.tensor([True, False])),
        kvspec.KVShapeError,
        r"indices as a boolean mask must have shape \[3\]",
    ),
    "hf-reorder-float": (
        lambda c: filled_hf(),
        lambda o, c: o.reorder_cache(torch.tensor([0.5])),
        kvspec.KVShapeError,
        "beam_idx must be a 1-D integer tensor",
    ),
    "hf-crop-float": (
        lambda c: filled_hf(),
        lambda o, c: o.crop(1.5),
        kvspec.KVTrimError,
        "max_length must be an integer; got 1.5",
    ),
    "hf-storage-bytes-negative-layer": (
        lambda c: filled_hf(),
        lambda o, c: o.storage_bytes(-1),
        kvspec.KVConfigError,
        "layer_idx=-1 is not a codec layer",
    ),
    # patches on models
    "apply-flash-codec-on-object": (
        None,
        lambda o, c: apply_flash_codec(object()),
        kvspec.KVConfigError,
        "model must be a transformers model with generate",
    ),
    "remove-flash-codec-on-object": (
        None,
        lambda o, c: remove_flash_codec(3),
        kvspec.KVConfigError,
        "model must be a transformers model",
    ),
    "apply-codec-attention-on-object": (
        None,
        lambda o, c: apply_codec_attention(SimpleNamespace()),
        kvspec.KVConfigError,
        "model must be a torch.nn.Module; got SimpleNamespace",
    ),
    "remove-codec-attention-on-object": (
        None,
        lambda o, c: remove_codec_attention(object()),
        kvspec.KVConfigError,
        "model must be a torch.nn.Module; got object",
    ),
    "apply-codec-attention-bad-backend": (
        model,
        lambda o, c: apply_codec_attention(o, backend="cuda"),
        kvspec.KVConfigError,
        "backend must be one of",
    ),
    "apply-flash-codec-bad-flag": (
        model,
        lambda o, c: apply_flash_codec(o, materialization_free="yes"),
        kvspec.KVConfigError,
        "materialization_free must be True, False or None",
    ),
    "apply-flash-codec-bad-per-layer": (
        model,
        lambda o, c: apply_flash_codec(o, per_layer={9: {"keep_freqs": 2}}),
        kvspec.KVConfigError,
        "per_layer names layer 9",
    ),
    "calibration-unknown-candidate": (
        None,
        lambda o, c: Calibration(schedule={0: "b"}, candidates={"a": PNGCodec()}, budget=1.0, ratio=1.0),
        kvspec.KVConfigError,
        r"schedule names candidates \['b'\]",
    ),
    "calibration-negative-budget": (
        None,
        lambda o, c: Calibration(schedule={}, candidates={}, budget=-1.0, ratio=1.0),
        kvspec.KVConfigError,
        "budget must be a finite number >= 0",
    ),
    # files
    "calibration-missing-file": (
        lambda c: c.tmp,
        lambda o, c: Calibration.load(o / "nope.json"),
        kvspec.KVDataError,
        "nope.json.*cannot be read",
    ),
    "calibration-corrupt-json": (
        corrupt_json,
        lambda o, c: Calibration.load(o),
        kvspec.KVDataError,
        "schedule.json.*cannot be read as JSON",
    ),
    "calibration-edited-after-save": (
        tampered,
        lambda o, c: Calibration.load(o),
        kvspec.KVDataError,
        "schedule.json.*fails its sha256 check",
    ),
}


@pytest.fixture(scope="module")
def tiny():
    return tiny_qwen3()


def test_the_catalogue_is_long_enough():
    with_target = [name for name, (target, *_) in CATALOGUE.items() if target is not None]
    assert len(CATALOGUE) >= 40 and len(with_target) >= 40


def _snap(obj):
    if isinstance(obj, Path):
        return (
            sorted((p.name, p.read_bytes()) for p in obj.parent.iterdir())
            if obj.is_file()
            else sorted((p.name, p.read_bytes()) for p in obj.iterdir())
        )
    return snapshot(obj)


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_bad_input(name, tmp_path, tiny):
    target, call, error, pattern = CATALOGUE[name]
    ctx = SimpleNamespace(tmp=tmp_path, model=tiny)
    obj = None if target is None else target(ctx)
    before = _snap(obj)
    with pytest.raises(error, match=pattern) as info:
        call(obj, ctx)
    assert isinstance(info.value, kvspec.KVSpecError) and isinstance(info.value, (ValueError, TypeError))
    assert _snap(obj) == before, f"{name}: the object changed although the call raised"
