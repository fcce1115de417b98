"""Transactional edits and what callers are handed.

* A failure *after* validation (out of memory while growing the values archive, while decoding the
  block a crop cuts into, while gathering for a reorder) leaves the cache exactly as it was: both
  streams are prepared before either commits, so the keys are never a block ahead of the values.
* ``read()`` views and ``state`` cannot change the cache behind its back: ``state`` is a copy, and a
  write into a returned view is noticed (version counter) and decoded again from the archive.
* Caches and transformers caches deep-copy and pickle, and the copies continue independently.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import CODECS, random_walk
from flashcodec import CodecKVCache, JPEGCodec, PNGCodec
from flashcodec.stream import CodecStream
from kvspec import KVConfigError, KVDataError, KVDtypeError
from snapshots import snapshot


class _OutOfMemory(RuntimeError):
    pass


def _fail_on_values(monkeypatch, method: str) -> None:
    """Make ``CodecStream.<method>`` raise on the values stream only (the second stream prepared)."""
    original = getattr(CodecStream, method)

    def failing(self, *args, **kwargs):
        if self.dim == 8:  # the values stream of the caches below (keys have D = 16)
            raise _OutOfMemory("CUDA out of memory (simulated)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CodecStream, method, failing)


def _check_failure_changes_nothing(cache, monkeypatch, method: str, call) -> None:
    """``call()``, with ``CodecStream.<method>`` failing on the values stream, raises and leaves
    ``cache`` (a flashcodec cache of either API) exactly as it was."""
    before = snapshot(cache)
    _fail_on_values(monkeypatch, method)
    with pytest.raises(_OutOfMemory):
        call()
    assert snapshot(cache) == before


def _check_next_append_as_twin(cache: CodecKVCache, twin: CodecKVCache, tokens: int, monkeypatch) -> None:
    """Without the failure, the next append gives ``cache`` what it gives ``twin`` (never failed)."""
    monkeypatch.undo()
    k, v = random_walk(s=tokens, seed=2), random_walk(s=tokens, d=8, seed=3)
    ours, theirs = cache.update_and_fetch(k, v), twin.update_and_fetch(k, v)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def _cache(tier: str) -> CodecKVCache:
    cache = CodecKVCache(codec=CODECS[tier], initial_blocks=1)
    cache.update_and_fetch(random_walk(s=13), random_walk(s=13, d=8, seed=1))
    return cache


@pytest.mark.parametrize("tier", ["png-keep1", "jpeg-k2-int8", "jpeg-k8-int4"])
def test_values_allocation_failure_leaves_both_streams(tier, monkeypatch):
    cache, twin = _cache(tier), _cache(tier)
    _check_failure_changes_nothing(
        cache,
        monkeypatch,
        "prepare_append",
        lambda: cache.update_and_fetch(random_walk(s=11, seed=2), random_walk(s=11, d=8, seed=3)),
    )
    assert cache.keys.n_blocks == cache.values.n_blocks
    _check_next_append_as_twin(cache, twin, 11, monkeypatch)


@pytest.mark.parametrize("tier", ["png-keep1", "jpeg-k2-int8"])
@pytest.mark.parametrize("tokens", [3, 11, 40])
def test_read_failure_after_the_append_undoes_it(tier, tokens, monkeypatch):
    # the keys' read succeeds (its view may grow), the values' read runs out of memory: the
    # append is undone and the keys' view is back to what it was
    cache, twin = _cache(tier), _cache(tier)
    _check_failure_changes_nothing(
        cache,
        monkeypatch,
        "_ensure_view",
        lambda: cache.update_and_fetch(random_walk(s=tokens, seed=2), random_walk(s=tokens, d=8, seed=3)),
    )
    _check_next_append_as_twin(cache, twin, tokens, monkeypatch)


def test_forward_failure_keeps_the_old_tokens(monkeypatch):
    cache = _cache("png-keep1")
    before = snapshot(cache)

    def forward():
        cache.forward(random_walk(s=20, seed=4), random_walk(s=20, d=8, seed=5))

    _check_failure_changes_nothing(cache, monkeypatch, "prepare_append", forward)
    monkeypatch.undo()
    _check_failure_changes_nothing(
        cache, monkeypatch, "_ensure_view", forward
    )  # the read after the fill fails
    assert snapshot(cache) == before


@pytest.mark.parametrize(
    ("method", "call"),
    [
        ("prepare_crop", lambda c: c.crop(5)),
        ("prepare_reorder", lambda c: c.reorder(torch.tensor([1, 0, 0]))),
    ],
)
def test_edit_failure_leaves_both_streams(method, call, monkeypatch):
    cache = _cache("jpeg-k2-int8")
    cache.release_view()  # the crop must decode the block it cuts into (an allocation)
    _check_failure_changes_nothing(cache, monkeypatch, method, lambda: call(cache))


def test_state_is_a_copy():
    cache = _cache("png-keep1")
    k_before = cache.read()[0].clone()
    for t in cache.state:
        t.fill_(3.0) if t.is_floating_point() else t.fill_(1)
    cache.release_view()
    assert torch.equal(cache.read()[0], k_before)


@pytest.mark.parametrize("tier", ["png-keep1", "jpeg-k2-int8"])
def test_writing_into_a_read_view_never_changes_the_cache(tier):
    cache, twin = _cache(tier), _cache(tier)
    k, v = cache.read()
    k.mul_(0.0)
    v[:, :, 2:5] = 9.0  # through a further view of the returned one
    again = cache.read()
    assert torch.equal(again[0], twin.read()[0]) and torch.equal(again[1], twin.read()[1])
    k, _ = cache.read()
    k.add_(1.0)
    cache.crop(11)  # a crop inside a block takes its head from the view only when it is trusted
    twin.crop(11)
    assert torch.equal(cache.read()[0], twin.read()[0])


def test_fp16_jpeg_outputs_saturate_instead_of_inf():
    # a step to 65000 kept at 2 frequencies overshoots by ~13% (truncation ringing); the int8
    # coefficients and fp32 scales hold it, and the fp16 output saturates at 65504 instead of inf
    x = torch.zeros(1, 1, 8, 4, dtype=torch.float16)
    x[:, :, 4:] = 65000.0
    cache = CodecKVCache(codec=JPEGCodec(8, keep_freqs=2, quant_bits=8))
    k, _ = cache.update_and_fetch(x, x)
    assert torch.isfinite(k).all() and float(k.max()) == 65504.0


def test_fp16_jpeg_overflow_is_refused_and_png_keeps_it():
    big = torch.full((1, 1, 8, 4), 30000.0, dtype=torch.float16)
    with pytest.raises(ValueError, match="overflow"):
        CodecKVCache(codec=JPEGCodec(8)).update_and_fetch(big, big)
    k, _ = CodecKVCache(codec=PNGCodec(8)).update_and_fetch(big, big)
    assert torch.equal(k, big)
    k, _ = CodecKVCache(codec=JPEGCodec(8, quant_bits=8)).update_and_fetch(big, big)  # fp32 scales hold it
    assert torch.isfinite(k).all()


@pytest.mark.parametrize("tier", list(CODECS))
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_cache_copies_continue_independently(tier, how):
    cache = _cache(tier)
    cache.read()
    twin = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
    assert snapshot(twin) == snapshot(cache)
    k, v = random_walk(s=6, seed=7), random_walk(s=6, d=8, seed=8)
    ours = tuple(t.clone() for t in cache.update_and_fetch(k, v))
    theirs = twin.update_and_fetch(k, v)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    cache.crop(3)
    assert twin.offset == 19


def test_transformers_cache_copies():
    pytest.importorskip("transformers")
    from flashcodec.hf import FlashCodecCache

    cache = FlashCodecCache(codec=JPEGCodec(8, keep_freqs=2))
    for i in range(2):
        cache.update(random_walk(s=13, seed=i), random_walk(s=13, seed=i + 5), i)
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert snapshot(twin) == snapshot(cache)
        x = random_walk(s=1, seed=9)
        assert torch.equal(twin.update(x, x, 0)[0], copy.deepcopy(cache).update(x, x, 0)[0])
        assert cache.get_seq_length() == 13 and twin.get_seq_length() == 14


@pytest.mark.parametrize("version,dropped", [(1, ("offset=", "dtype=")), (2, ("dtype=",))])
def test_only_the_current_meta_state_format_loads(version, dropped):
    # formats 1 and 2 were never released: no reader is kept for them
    cache = _cache("jpeg-k2-int8")
    old = tuple(
        f"format=flashcodec-cache-{version}" if m.startswith("format=") else m
        for m in cache.meta_state
        if not m.startswith(dropped)
    )
    with pytest.raises(KVConfigError, match="meta_state format must be 'flashcodec-cache-3'"):
        CodecKVCache.from_state(cache.state, old)


@pytest.mark.parametrize("entry", ["offset", "dtype"])
def test_a_meta_state_without_its_offset_or_dtype_is_refused_naming_it(entry):
    # every meta_state records both (dtype=None for an empty cache): no state is read without them
    cache = _cache("jpeg-k2-int8")
    partial = tuple(m for m in cache.meta_state if not m.startswith(f"{entry}="))
    with pytest.raises(KVConfigError, match=f"meta_state is missing the entry '{entry}'"):
        CodecKVCache.from_state(cache.state, partial)


def test_calibration_files_round_trip_and_files_without_the_format_are_refused(tmp_path):
    pytest.importorskip("transformers")
    import json

    from flashcodec.hf import Calibration

    cal = Calibration(
        schedule={0: "a", 1: "b"},
        candidates={"a": PNGCodec(8), "b": JPEGCodec(8, 2)},
        budget=0.5,
        ratio=0.4,
        predicted_kl=0.25,
        measured_kl=0.5,
        tokens=10,
    )
    path = tmp_path / "cal.json"
    cal.save(path)
    assert "sha256" in json.loads(path.read_text())
    assert Calibration.load(path) == cal
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(cal.to_dict()))  # no format, no checksum: not a file save writes
    with pytest.raises(KVDataError, match="is not a 'flashcodec-calibration-file-1' file"):
        Calibration.load(bare)


@pytest.mark.parametrize(
    ("method", "call"),
    [
        ("prepare_reorder", lambda c: c.reorder_cache(torch.tensor([1, 0, 0]))),
        ("prepare_reorder", lambda c: c.batch_select_indices(torch.tensor([-1]))),
        ("prepare_reorder", lambda c: c.batch_repeat_interleave(2)),
        ("prepare_crop", lambda c: c.crop(-3)),
    ],
)
def test_transformers_cache_edits_are_all_or_nothing(method, call, monkeypatch):
    # layer 0 is edited without trouble, layer 1's values run out of memory: no layer changes
    pytest.importorskip("transformers")
    from flashcodec.hf import FlashCodecCache

    cache = FlashCodecCache(codec=JPEGCodec(8, keep_freqs=2, quant_bits=8))
    cache.update(random_walk(s=13), random_walk(s=13, seed=1), 0)
    cache.update(random_walk(s=13, seed=2), random_walk(s=13, d=8, seed=3), 1)
    for layer in cache.layers:
        layer.codec_cache.release_view()  # so the crop decodes (allocates) the block it cuts into
    _check_failure_changes_nothing(cache, monkeypatch, method, lambda: call(cache))


def test_failed_update_of_a_native_layer_leaves_it_as_it_was():
    # a chunked-attention layer kept native in a FlashCodecCache: a mismatched update fails inside
    # transformers (torch.cat); the layer gets its attributes back
    pytest.importorskip("transformers")
    from flashcodec.hf import FlashCodecCache
    from test_hf_cache import tiny_qwen3

    config = tiny_qwen3(layer_types=["full_attention", "full_attention"]).config
    config.layer_types, config.attention_chunk_size = ["full_attention", "chunked_attention"], 6
    cache = FlashCodecCache.from_config(config)
    fresh = snapshot(cache)
    with pytest.raises((TypeError, AttributeError)):  # fails inside transformers
        cache.update(random_walk(s=3), random_walk(s=3).tolist(), 1)
    assert snapshot(cache) == fresh and not cache.layers[1].is_initialized
    cache.update(random_walk(s=3), random_walk(s=3, seed=1), 1)
    before = snapshot(cache)
    with pytest.raises(RuntimeError):
        cache.update(random_walk(s=3, b=1), random_walk(s=3, b=1), 1)
    assert snapshot(cache) == before


def test_a_cache_partly_filled_under_inference_mode_refuses_writes_outside_it():
    # filled outside, then a step inside that regrows the archive: the new archive buffers are
    # inference tensors, so the next append outside (which would write a block into them) is
    # refused up front, the cache unchanged
    x = random_walk(s=56)
    cache = CodecKVCache(codec=PNGCodec(8))
    cache.update_and_fetch(x[:, :, :13], x[:, :, :13])
    assert not cache.keys.buffers_are_inference()
    with torch.inference_mode():
        cache.update_and_fetch(x[:, :, 13:53], x[:, :, 13:53])
    assert cache.keys.buffers_are_inference() and cache.values.buffers_are_inference()
    before = snapshot(cache)
    with pytest.raises(KVDtypeError, match="inference_mode"):
        cache.update_and_fetch(x[:, :, 53:], x[:, :, 53:])
    assert snapshot(cache) == before
    with torch.inference_mode():
        k, _ = cache.update_and_fetch(x[:, :, 53:], x[:, :, 53:])
    assert torch.equal(k, x)


def test_a_cache_filled_under_inference_mode():
    # read outside inference_mode: the view is rebuilt as a normal tensor; in-place writes to the
    # inference-tensor buffers (append, a crop inside a block) are refused up front, unchanged
    x = random_walk(s=13)
    with torch.inference_mode():
        cache = CodecKVCache(codec=PNGCodec(8))
        cache.update_and_fetch(x, x)
    assert torch.equal(cache.read()[0], x)
    before = snapshot(cache)
    with pytest.raises(KVDtypeError, match="inference_mode"):
        cache.update_and_fetch(x[:, :, :2], x[:, :, :2])
    with pytest.raises(KVDtypeError, match="inference_mode"):
        cache.crop(5)
    assert snapshot(cache) == before
    with torch.inference_mode():
        k, _ = cache.update_and_fetch(x[:, :, :2], x[:, :, :2])
    assert torch.equal(k, torch.cat([x, x[:, :, :2]], dim=2))
