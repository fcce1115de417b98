"""The hot patch: per instance, reversible, idempotent, and only where transformers would build its default cache.

Runs on a seeded random 4-layer Qwen3 built in memory (fast); the embedded-model token
equality of the patched model is in ``test_hf_generate.py``.
"""

from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

import flashcodec  # noqa: E402
from conftest import TOKEN_IDS, tiny_model  # noqa: E402
from flashcodec import JPEGCodec, PNGCodec  # noqa: E402
from flashcodec.hf import FlashCodecCache, apply_flash_codec, get_flash_codec_patch, remove_flash_codec  # noqa: E402
from kvspec import KVConfigError  # noqa: E402
from transformers import DynamicCache, Qwen3ForCausalLM  # noqa: E402

GEN = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)


def tiny_qwen3(seed=0) -> Qwen3ForCausalLM:
    """A seeded random 4-layer Qwen3 that generates (its special tokens set)."""
    return tiny_model(seed=seed, layers=4, max_positions=256, **TOKEN_IDS)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3()


@pytest.fixture
def ids():
    return torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))


def caches_built(model) -> int:
    patch = get_flash_codec_patch(model)
    return 0 if patch is None else patch.caches_built


def test_patched_generate_uses_a_codec_cache_laid_out_by_the_config(model, ids):
    base = model.generate(ids, **GEN)
    apply_flash_codec(model, mode="png", keep_ratio=1.0)
    try:
        out = model.generate(ids, return_dict_in_generate=True, **GEN)
        assert (
            isinstance(out.cache, FlashCodecCache) and out.cache is get_flash_codec_patch(model).last_cache()
        )
        assert caches_built(model) == 1
        assert out.cache.codec_layer_indices == [0, 1, 2, 3]
        assert torch.equal(out.sequences, base)
    finally:
        remove_flash_codec(model)


def test_apply_with_a_codec_object_equals_the_keyword_form(model, ids):
    apply_flash_codec(model, codec=JPEGCodec(8, keep_freqs=2, quant_bits=8), per_layer={3: PNGCodec(8)})
    try:
        out = model.generate(ids, return_dict_in_generate=True, **GEN)
        assert get_flash_codec_patch(model).options["codec"] == JPEGCodec(8, 2, 8)
    finally:
        remove_flash_codec(model)
    apply_flash_codec(model, mode="jpeg", keep_freqs=2, quant_bits=8, per_layer={3: {"mode": "png"}})
    try:
        twin = model.generate(ids, return_dict_in_generate=True, **GEN)
    finally:
        remove_flash_codec(model)
    codecs = [layer.codec_cache.codec for layer in out.cache.layers]
    assert codecs == [JPEGCodec(8, 2, 8)] * 3 + [PNGCodec(8)]
    assert codecs == [layer.codec_cache.codec for layer in twin.cache.layers]
    assert torch.equal(out.sequences, twin.sequences)


def test_apply_refuses_a_codec_object_with_keywords(model):
    with pytest.raises(KVConfigError, match="not both"):
        apply_flash_codec(model, codec=PNGCodec(), mode="png")
    assert "generate" not in vars(model)


def test_remove_restores_generate_exactly_and_no_class_is_touched(model, ids):
    class_generate = type(model).generate
    before_dict = dict(vars(model))
    before = model.generate(ids, **GEN)
    other = tiny_qwen3(seed=1)
    signature = inspect.signature(model.generate)
    apply_flash_codec(model, mode="jpeg", keep_freqs=2, quant_bits=8)
    assert type(model).generate is class_generate  # the class is untouched
    assert inspect.signature(model.generate) == signature  # introspection sees the same parameters
    assert "generate" not in vars(other)  # other instances are untouched
    other.generate(ids, **GEN)
    assert get_flash_codec_patch(other) is None
    assert remove_flash_codec(model) is True
    assert dict(vars(model)) == before_dict and "generate" not in vars(model)
    assert torch.equal(model.generate(ids, **GEN), before)
    assert remove_flash_codec(model) is False  # removing twice is harmless


def test_apply_twice_replaces_the_options_without_stacking(model, ids):
    apply_flash_codec(model, mode="jpeg", keep_freqs=2)
    first = vars(model)["generate"]
    apply_flash_codec(model, mode="png")
    try:
        assert get_flash_codec_patch(model).options["mode"] == "png"
        assert vars(model)["generate"] is not first
        assert get_flash_codec_patch(model).original_generate is not first  # never wraps a wrapper
        out = model.generate(ids, return_dict_in_generate=True, **GEN)
        assert out.cache.layers[0].codec_cache.codec.mode == "png"
    finally:
        remove_flash_codec(model)
    assert "generate" not in vars(model)


def test_remove_restores_a_preexisting_instance_generate(ids):
    model = tiny_qwen3()
    calls = []

    def custom(*args, **kwargs):
        calls.append(kwargs.get("cache"))
        return type(model).generate(model, *args, **kwargs)

    own = functools.partial(custom)
    vars(model)["generate"] = own  # e.g. what from_pretrained does for a custom_generate repo
    apply_flash_codec(model, mode="png")
    model.generate(ids, **GEN)
    assert isinstance(calls[-1], FlashCodecCache)  # the patch wraps the instance's own generate
    remove_flash_codec(model)
    assert vars(model)["generate"] is own


@pytest.mark.parametrize(
    "extra",
    [
        dict(cache_implementation="static"),
        dict(use_cache=False),
        dict(cache="dynamic"),
    ],
    ids=["cache-implementation", "no-cache", "own-cache"],
)
def test_calls_that_choose_their_cache_pass_through(model, ids, extra):
    if extra.get("cache") == "dynamic":
        extra = dict(cache=DynamicCache(config=model.config))
    base = model.generate(ids, **GEN, **extra) if "cache" not in extra else None
    apply_flash_codec(model, mode="jpeg", keep_freqs=2)
    try:
        out = model.generate(ids, **GEN, **extra)
        assert caches_built(model) == 0  # no codec cache was built for this call
        if base is not None:
            assert torch.equal(out, base)
    finally:
        remove_flash_codec(model)


def test_generation_config_use_cache_false_passes_through(model, ids):
    apply_flash_codec(model, mode="png")
    try:
        config = model.generation_config.__class__(**model.generation_config.to_dict())
        config.use_cache = False
        model.generate(ids, config, **GEN)  # generation_config given positionally
        assert caches_built(model) == 0
        model.generate(ids, **GEN)
        assert caches_built(model) == 1
    finally:
        remove_flash_codec(model)


def test_rejected_apply_leaves_the_model_and_an_existing_patch_as_they_were(model):
    with pytest.raises(KVConfigError, match="keep_freqs"):
        apply_flash_codec(model, mode="jpeg", keep_freqs=99)
    assert "generate" not in vars(model)
    apply_flash_codec(model, mode="png")
    try:
        with pytest.raises(KVConfigError, match="has 4 layers"):
            apply_flash_codec(model, per_layer={9: {"keep_freqs": 2}})
        assert get_flash_codec_patch(model).options["mode"] == "png"
    finally:
        remove_flash_codec(model)


def test_apply_rejects_encoder_decoder_and_non_models():
    fake = SimpleNamespace(generate=lambda: None, config=SimpleNamespace(is_encoder_decoder=True))
    with pytest.raises(KVConfigError, match="decoder-only"):
        apply_flash_codec(fake)
    with pytest.raises(KVConfigError, match="generate"):
        apply_flash_codec(object())


def test_top_level_lazy_exports_are_the_hf_objects():
    assert flashcodec.apply_flash_codec is apply_flash_codec
    assert flashcodec.remove_flash_codec is remove_flash_codec
    assert flashcodec.FlashCodecCache is FlashCodecCache
    with pytest.raises(AttributeError):
        flashcodec.not_a_name  # noqa: B018
