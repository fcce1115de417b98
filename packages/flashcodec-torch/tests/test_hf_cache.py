"""FlashCodecCache / FlashCodecLayer against transformers' Cache API, on tiny in-memory models.

Covers the layer contract (update views, masks, crop / reorder / reset), option and per-layer
validation, the layout built from a config (hybrid linear/full attention, sliding windows), the
ImportError for transformers without the layer API, and that ``import flashcodec`` stays light.
The embedded-model evidence (token equality over 64+ tokens, beam search, int8 tiers) lives in
``test_hf_generate.py``.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from conftest import TOKEN_IDS, tiny_model  # noqa: E402
from flashcodec import CodecKVCache, JPEGCodec, PNGCodec  # noqa: E402
from flashcodec.hf import (  # noqa: E402
    FlashCodecCache,
    FlashCodecLayer,
    apply_codec_attention,
    remove_codec_attention,
)
from flashcodec.hf.requirements import check_layer_api  # noqa: E402
from flashcodec.hf.sliding_layer import FlashCodecSlidingLayer, window_codec  # noqa: E402
from flashcodec.tiers import default_codec  # noqa: E402
from kvspec import KVConfigError, KVShapeError, KVTrimError  # noqa: E402
from transformers import DynamicCache, Qwen3ForCausalLM  # noqa: E402
from transformers.cache_utils import LinearAttentionLayer  # noqa: E402


def make_hybrid_model():
    from hybrid_fixture import make_tiny_hybrid_model

    return make_tiny_hybrid_model(seed=0)


def tiny_qwen3(layer_types=None, sliding_window=None, seed=0) -> Qwen3ForCausalLM:
    """A seeded random 4-layer Qwen3 (GQA 4/2 heads, head_dim 16), float32, eval mode."""
    return tiny_model(
        seed=seed,
        layers=len(layer_types) if layer_types else 4,
        max_positions=256,
        layer_types=list(layer_types) if layer_types else None,
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
        max_window_layers=0,
        **TOKEN_IDS,
    )


def kv(b=2, h=2, s=11, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(b, h, 1, d, generator=g) + 0.1 * torch.randn(b, h, s, d, generator=g).cumsum(2)).to(
        dtype
    )
    v = (torch.randn(b, h, 1, d, generator=g) + 0.1 * torch.randn(b, h, s, d, generator=g).cumsum(2)).to(
        dtype
    )
    return k, v


def ids_of(n, vocab=128, seed=0, batch=1):
    return torch.randint(3, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the layer
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_update_returns_full_views_in_input_dtype(dtype):
    layer = FlashCodecLayer(mode="png", step_raw=False)  # the stored form's view itself
    k, v = kv(s=11, dtype=dtype)
    out_k, out_v = layer.update(k[:, :, :7], v[:, :, :7])
    out_k, out_v = layer.update(k[:, :, 7:], v[:, :, 7:])
    assert out_k.dtype == dtype and out_k.shape == (2, 2, 11, 16)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)  # png keep=1.0 is bitwise lossless
    assert layer.keys is out_k and layer.get_seq_length() == 11
    assert layer.get_mask_sizes(3) == (14, 0) and layer.get_max_length() == -1


def test_layer_crop_conventions_and_errors():
    layer = FlashCodecLayer(mode="jpeg", keep_freqs=2)
    k, v = kv(s=21)
    layer.update(k, v)
    full_k = layer.keys.clone()  # the stored form (update returned the step's tokens raw)
    layer.crop(0)  # transformers 5.x: crop(0) must not drop anything
    assert layer.get_seq_length() == 21
    layer.crop(-5)  # drop the last 5 tokens
    assert layer.get_seq_length() == 16 and torch.equal(layer.keys, full_k[:, :, :16])
    layer.crop(13)  # older absolute form: keep 13 (cuts inside an archived block)
    assert layer.get_seq_length() == 13 and torch.equal(layer.keys, full_k[:, :, :13])
    for bad in (1.5, True, "3"):
        with pytest.raises(KVTrimError, match="integer"):
            layer.crop(bad)
    assert layer.get_seq_length() == 13 and torch.equal(layer.keys, full_k[:, :, :13])


def test_layer_reorder_select_repeat_and_reset():
    layer = FlashCodecLayer(mode="png")
    k, v = kv(b=3, s=10)
    layer.update(k, v)
    layer.reorder_cache(torch.tensor([2, 0, 0]))
    assert torch.equal(layer.keys, k[[2, 0, 0]])
    layer.batch_select_indices(torch.tensor([True, False, True]))
    assert torch.equal(layer.values, v[[2, 0]])
    layer.batch_repeat_interleave(2)
    assert torch.equal(layer.keys, k[[2, 2, 0, 0]])
    with pytest.raises(KVShapeError):
        layer.reorder_cache(torch.tensor([5]))
    assert layer.keys.shape[0] == 4  # the rejected reorder changed nothing
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.keys is None and not layer.is_initialized
    layer.update(*kv(b=1, s=3, d=8))  # after reset, a new shape is accepted
    assert layer.keys.shape == (1, 2, 3, 8)


def test_layer_rejected_update_leaves_layer_unchanged():
    layer = FlashCodecLayer(mode="jpeg", keep_freqs=4, quant_bits=8)
    k, v = kv(s=9)
    layer.update(k, v)
    before = tuple(t.clone() for t in layer.codec_cache.read())
    bad = k[:, :, :2].clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError):
        layer.update(bad, v[:, :, :2])
    with pytest.raises(TypeError):
        layer.update(k[:, :, :2].double(), v[:, :, :2].double())
    assert layer.get_seq_length() == 9 and torch.equal(layer.codec_cache.read()[0], before[0])


def test_layer_storage_is_measured_from_the_held_tensors():
    layer = FlashCodecLayer(mode="jpeg", keep_freqs=2, quant_bits=8)
    layer.update(*kv(s=37))
    storage = layer.storage_bytes()
    assert storage.held == sum(t.nbytes for t in layer.codec_cache.state)
    assert storage.raw == 2 * (2 * 2 * 37 * 16 * 4) and storage.ratio < 0.25


# ---------------------------------------------------------------- options and per_layer
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="gif"), "mode"),
        (dict(mode="jpeg", keep_freqs=9), "keep_freqs"),
        (dict(mode="png", keep_freqs=2), "keep_freqs"),
        (dict(per_layer={0: {"keep_freqz": 2}}), "keep_freqz"),
        (dict(per_layer={-1: {"keep_freqs": 2}}), "layer indices"),
        (dict(per_layer={"0": {"keep_freqs": 2}}), "layer indices"),
        (dict(per_layer={0: 2}), "per_layer\\[0\\]"),
        (dict(per_layer=[{"keep_freqs": 2}]), "per_layer must be a dict"),
        (dict(per_layer={1: {"keep_freqs": 0}}), "per_layer\\[1\\]"),
        (dict(codec=JPEGCodec(), keep_freqs=2), "not both"),
        (dict(codec="png"), "codec must be a codec object"),
        (dict(per_layer={0: {"codec": PNGCodec(), "mode": "png"}}), "per_layer\\[0\\]: .*not both"),
        (dict(per_layer={0: {"codec": "png"}}), "per_layer\\[0\\]: codec must be a codec object"),
        (dict(per_layer={0: {"check_finite": 1}}), "per_layer\\[0\\]: check_finite"),
    ],
    ids=["mode", "keep-freqs-range", "png-keep-freqs", "unknown-option", "negative-idx", "str-idx", "not-dict",
         "list", "bad-value", "codec-and-keywords", "codec-not-object", "layer-codec-and-keywords",
         "layer-codec-not-object", "layer-check-finite"],
)  # fmt: skip
def test_bad_options_raise_config_errors(kwargs, match):
    with pytest.raises(KVConfigError, match=match):
        FlashCodecCache(**kwargs)


def test_per_layer_without_config_is_applied_when_layers_appear():
    cache = FlashCodecCache(
        mode="jpeg", keep_freqs=8, per_layer={1: {"keep_freqs": 2, "quant_bits": 8}, 2: {"mode": "png"}}
    )
    for idx in range(3):
        cache.update(*kv(s=9, seed=idx), layer_idx=idx)
    codecs = [layer.codec_cache.codec for layer in cache.layers]
    assert (codecs[0].mode, codecs[0].keep_freqs, codecs[0].quant_bits) == ("jpeg", 8, None)
    assert (codecs[1].mode, codecs[1].keep_freqs, codecs[1].quant_bits) == ("jpeg", 2, 8)
    assert codecs[2].mode == "png"  # switching mode dropped the jpeg-only keep_freqs default
    assert cache.storage_bytes(1).held < cache.storage_bytes(0).held


def test_per_layer_takes_codec_objects_and_cache_options():
    cache = FlashCodecCache(
        codec=JPEGCodec(8),
        initial_blocks=4,
        per_layer={
            1: JPEGCodec(8, 2, 8),
            2: {"codec": PNGCodec(4), "check_finite": False},
            3: {"keep_freqs": 4},
        },
    )
    for idx in range(4):
        cache.update(*kv(s=9, seed=idx), layer_idx=idx)
    inner = [layer.codec_cache for layer in cache.layers]
    assert [c.codec for c in inner] == [JPEGCodec(8), JPEGCodec(8, 2, 8), PNGCodec(4), JPEGCodec(8, 4)]
    assert [c.check_finite for c in inner] == [True, True, False, True]
    assert all(c.initial_blocks == 4 for c in inner)  # cache-wide options reach overridden layers too
    assert cache.codec_defaults == {"codec": JPEGCodec(8), "check_finite": True, "initial_blocks": 4}


def test_dict_overrides_merge_over_the_keyword_form_as_given():
    # keep_freqs left unset follows the layer's block size, as in the keyword form
    cache = FlashCodecCache(mode="jpeg", per_layer={0: {"block_size": 4}})
    cache.update(*kv(s=9), layer_idx=0)
    assert cache.layers[0].codec_cache.codec == JPEGCodec(4, keep_freqs=4)


# ---------------------------------------------------------------- layout from a config
def test_hybrid_fixture_gets_codec_layers_only_on_full_attention_and_exact_tokens():
    model = make_hybrid_model()
    ids = ids_of(13, vocab=256)
    base = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = FlashCodecCache.from_config(model.config, mode="png")
        out = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, cache=cache)
    assert [str(w.message) for w in caught] == []
    assert cache.codec_layer_indices == [1, 3] and cache.native_layer_indices == [0, 2]
    assert all(isinstance(cache.layers[i], LinearAttentionLayer) for i in (0, 2))
    assert torch.equal(out, base)
    assert cache.get_seq_length() == 13 + 20 - 1
    assert cache.storage_bytes().held == sum(cache.storage_bytes(i).held for i in (1, 3))
    assert cache.native_nbytes() > 0  # recurrent and conv states, measured, not counted as codec bytes


def test_hybrid_per_layer_must_name_a_full_attention_layer():
    model = make_hybrid_model()
    with pytest.raises(KVConfigError, match="kept native"):
        FlashCodecCache.from_config(model.config, per_layer={0: {"keep_freqs": 2}})
    with pytest.raises(KVConfigError, match="has 4 layers"):
        FlashCodecCache.from_config(model.config, per_layer={7: {"keep_freqs": 2}})
    cache = FlashCodecCache.from_config(model.config, keep_freqs=8, per_layer={3: {"keep_freqs": 2}})
    assert cache.layers[1].codec_cache.codec.keep_freqs == 8
    assert cache.layers[3].codec_cache.codec.keep_freqs == 2


def test_hybrid_crop_needs_past_recording_and_rejects_without_change():
    model = make_hybrid_model()
    cache = FlashCodecCache.from_config(model.config, mode="png")
    with torch.no_grad():
        model(ids_of(12, vocab=256), cache=cache)
    with pytest.raises(KVTrimError, match="past recording"):
        cache.crop(-3)
    assert cache.get_seq_length() == 12  # nothing was cropped
    recorded = FlashCodecCache.from_config(model.config, mode="png")
    recorded.activate_past_recording()
    with torch.no_grad():
        model(ids_of(12, vocab=256), cache=recorded)
    if takes_recurrent_states_to_keep():  # the step recorded no intermediate recurrent state
        with pytest.raises(KVTrimError, match="recurrent_states_to_keep=4"):
            recorded.crop(-3)
        assert recorded.get_seq_length() == 12
        return
    recorded.crop(-3)
    assert recorded.get_seq_length() == 9


def takes_recurrent_states_to_keep() -> bool:
    """Whether this transformers release records recurrent states for a crop (5.25 and newer)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return (
        "recurrent_states_to_keep"
        in inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters
    )


@pytest.mark.skipif(
    not takes_recurrent_states_to_keep(), reason="this transformers records no recurrent states"
)
def test_hybrid_crop_with_recorded_recurrent_states_matches_dynamic_cache():
    model = make_hybrid_model()
    ids = ids_of(12, vocab=256)
    native = DynamicCache(config=model.config)
    native.activate_past_recording(recurrent_states_to_keep=4)
    recorded = FlashCodecCache.from_config(model.config, mode="png")
    recorded.activate_past_recording(recurrent_states_to_keep=4)
    with torch.no_grad():
        for cache in (native, recorded):
            model(ids, cache=cache)
            cache.crop(-3)
        want = model(ids[:, 9:], cache=native).logits
        got = model(ids[:, 9:], cache=recorded).logits
    assert recorded.get_seq_length() == 12
    assert torch.allclose(got, want, atol=1e-5)  # png is lossless: the rolled-back state is the same


def test_activate_past_recording_rejects_a_bad_count_without_change():
    model = make_hybrid_model()
    cache = FlashCodecCache.from_config(model.config, mode="png")
    for bad in (-1, 2.5, True):
        with pytest.raises(KVConfigError, match="recurrent_states_to_keep"):
            cache.activate_past_recording(recurrent_states_to_keep=bad)
    assert not any(cache.is_recording_past(i) for i in range(len(cache.layers)))


@pytest.mark.parametrize("attention", ["materialized", "on the codes"])
def test_sliding_window_layers_are_bounded_codec_layers_and_match_dynamic_cache(attention):
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    model = tiny_qwen3(layer_types=types, sliding_window=6)
    cache = FlashCodecCache.from_config(model.config, mode="png")  # lossless: the same tokens
    assert cache.codec_layer_indices == [0, 1, 2, 3]
    assert all(type(cache.layers[i]) is FlashCodecSlidingLayer for i in (1, 3))
    ids = ids_of(30)
    base = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    if attention == "on the codes":
        apply_codec_attention(model, backend="torch")
    try:
        out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, cache=cache)
    finally:
        remove_codec_attention(model)
    assert torch.equal(out, base)
    sliding = cache.layers[1]
    assert cache.get_seq_length() == 41 and sliding.get_seq_length() == 41
    # whole 8-token blocks behind the window are gone: at most window - 1 + 7 tokens stay
    assert sliding.dropped > 0 and sliding.codec_cache.offset <= 6 - 1 + 7


def test_a_sliding_layer_crops_within_what_it_kept_and_refuses_beyond():
    types = ["full_attention", "sliding_attention"]
    model = tiny_qwen3(layer_types=types, sliding_window=6)
    ids = ids_of(40)
    cache = FlashCodecCache.from_config(model.config, mode="png")
    with torch.no_grad():
        model(ids[:, :37], cache=cache)
        model(ids[:, 37:38], cache=cache)  # the step drops the blocks behind the window
    sliding = cache.layers[1]
    seen, dropped = sliding.get_seq_length(), sliding.dropped
    assert seen == 38 and dropped == 32
    with pytest.raises(KVTrimError, match="forgot its first 32 tokens"):
        cache.crop(-2)  # the next query (position 36) would need position 31, dropped
    assert cache.get_seq_length() == 38 and sliding.dropped == 32  # nothing was cropped
    cache.crop(-1)  # position 37's window starts at 32: still held
    native = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :37], cache=native)
        want = model(ids[:, 37:40], cache=native).logits
        got = model(ids[:, 37:40], cache=cache).logits
    assert torch.allclose(got, want, atol=1e-5)


def test_a_sliding_layers_codec_keeps_its_tail_within_an_eighth_of_the_window():
    default = default_codec()  # 64-token blocks, a 64-token int8 window
    small = window_codec(default, 128)
    assert (small.block_size, small.raw_window) == (16, 0)
    assert (window_codec(default, 512).block_size, window_codec(default, 512).raw_window) == (64, 0)
    assert window_codec(default, 1024) is default and window_codec(default, 4096) is default
    assert window_codec(default, 40).block_size == 8  # never below 8 tokens
    png = PNGCodec(block_size=8)
    assert window_codec(png, 16) is png  # already within its share


def test_a_sliding_layers_archive_stays_within_the_window_as_it_decodes():
    types = ["full_attention", "sliding_attention"]
    model = tiny_qwen3(layer_types=types, sliding_window=128)
    cache = FlashCodecCache.from_config(model.config, codec=default_codec())
    ids = ids_of(200)
    with torch.no_grad():
        model(ids, cache=cache)  # a prefill longer than the window
        for step in range(40):
            model(ids[:, step : step + 1], cache=cache)
            for stream in (cache.layers[1].codec_cache.keys, cache.layers[1].codec_cache.values):
                # whole 16-token blocks: the window's 127 tokens and at most 15 behind it
                assert stream.n_blocks * 16 + stream.tail_len <= 127 + 15 + 16
                assert stream.capacity <= stream.n_blocks + 1  # no spare room kept after a drop


def test_config_without_an_attention_layer_to_code_warns_that_nothing_is_compressed():
    config = tiny_qwen3().config
    config.layer_types, config.attention_chunk_size = ["chunked_attention"] * 4, 4
    with pytest.warns(UserWarning, match="nothing is compressed"):
        cache = FlashCodecCache.from_config(config)
    assert cache.codec_layer_indices == []


def test_from_config_needs_a_config():
    with pytest.raises(KVConfigError, match="config"):
        FlashCodecCache.from_config(None)


def test_cache_crop_forms_match_dynamic_cache_exactly():
    model = tiny_qwen3()
    ids = ids_of(23)
    for form in (-7, 16):  # remove 7 (5.x form) / keep 16 (older absolute form)
        codec, native = (
            FlashCodecCache.from_config(model.config, mode="png"),
            DynamicCache(config=model.config),
        )
        with torch.no_grad():
            model(ids, cache=codec)
            model(ids, cache=native)
            codec.crop(form)
            native.crop(-7)
            assert codec.get_seq_length() == native.get_seq_length() == 16
            nxt = ids_of(5, seed=1)
            a = model(nxt, cache=codec).logits
            b = model(nxt, cache=native).logits
        assert torch.equal(a, b)


def test_cache_reset_and_reorder():
    model = tiny_qwen3()
    cache = FlashCodecCache.from_config(model.config, mode="png")
    with torch.no_grad():
        model(ids_of(10, batch=2), cache=cache)
    keys = cache.layers[0].keys.clone()
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(cache.layers[0].keys, keys[[1, 1]])
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.storage_bytes().held == 0


def test_storage_bytes_rejects_native_or_bad_layer_index():
    model = make_hybrid_model()
    cache = FlashCodecCache.from_config(model.config)
    with pytest.raises(KVConfigError, match="not a codec layer"):
        cache.storage_bytes(0)
    with pytest.raises(KVConfigError, match="integer"):
        cache.storage_bytes(1.0)


# ---------------------------------------------------------------- packaging
def test_transformers_without_layer_api_gets_a_clear_import_error():
    old_cache_utils = SimpleNamespace(Cache=object, DynamicCache=object)  # 4.x: no CacheLayerMixin
    with pytest.raises(ImportError, match=r"transformers>=5\.0.*found transformers 4\.46\.3"):
        check_layer_api("4.46.3", old_cache_utils)
    check_layer_api("5.0.0", SimpleNamespace(Cache=1, CacheLayerMixin=1, DynamicLayer=1))


def test_import_flashcodec_does_not_import_transformers():
    code = (
        "import sys, flashcodec\n"
        "assert 'transformers' not in sys.modules, 'eager transformers import'\n"
        "cls = flashcodec.FlashCodecCache\n"
        "assert 'transformers' in sys.modules and cls.__name__ == 'FlashCodecCache'\n"
        "assert flashcodec.apply_flash_codec.__module__ == 'flashcodec.hf.patch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_codec_layer_wraps_the_core_cache():
    layer = FlashCodecLayer(mode="jpeg", keep_freqs=4)
    assert isinstance(layer.codec_cache, CodecKVCache) and layer.codec_cache.codec == JPEGCodec(
        8, keep_freqs=4
    )
    assert FlashCodecLayer(codec=JPEGCodec(8, keep_freqs=4)).codec_cache.codec == layer.codec_cache.codec


def test_a_default_cache_on_a_decoded_view_says_how_to_attend_on_the_codes():
    model = tiny_qwen3()
    cache = FlashCodecCache.from_config(model.config)  # nothing chosen: the default tier
    with pytest.warns(UserWarning, match="apply_flash_codec"):
        with torch.no_grad():
            model(ids_of(9), cache=cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per cache
        with torch.no_grad():
            model(ids_of(1), cache=cache)
        chosen = FlashCodecCache.from_config(model.config, mode="png")  # a codec chosen: no advice
        with torch.no_grad():
            model(ids_of(9), cache=chosen)


def test_the_compare_harness_refuses_a_model_with_no_layer_to_code():
    from flashcodec.compare import build_candidates
    from kvbench.errors import CompareError

    model = tiny_qwen3()
    model.config.layer_types, model.config.attention_chunk_size = ["chunked_attention"] * 4, 4
    with pytest.raises(CompareError, match="cannot serve this model .* no attention layer to code"):
        build_candidates(model, ["png-keep1"], [])


def test_the_compare_harness_builds_tiers_given_outside_the_registry():
    from flashcodec.codecs import KIVICodec
    from flashcodec.compare import FlashCodecHarness, build_candidates
    from flashcodec.tiers import TIERS, Tier, make_registry, tier

    own = Tier("own-kivi", "a tier of the caller's", KIVICodec(32, key_bits=4, value_bits=8), "materialized")
    registry = make_registry(*TIERS.values(), own)
    before = dict(TIERS)

    def tier_of(name: str) -> Tier:
        return tier(name, registry=registry)

    built, absent = build_candidates(
        tiny_qwen3(), ["own-kivi", "png-keep1", "jpeg-k8-int8"], [], tier_of=tier_of
    )
    assert [c.name for c in built] == ["baseline", "own-kivi", "png-keep1", "jpeg-k8-int8"] and absent == []
    assert built[1].description.startswith("a tier of the caller's;") and built[1].config["codec"] == repr(
        own.codec
    )
    # each tier with its own attention: a decoded view has no context, the codes are applied around the run
    assert [c.config["attention"] for c in built[1:]] == ["materialized", "materialized", "codes"]
    assert built[1].context is None and built[3].context is not None
    # one attention for all, as --attention chooses it
    built, _ = build_candidates(
        tiny_qwen3(), ["own-kivi", "png-keep1"], [], tier_of=tier_of, attention="codes"
    )
    assert [c.config["attention"] for c in built[1:]] == ["codes", "codes"]
    assert all(c.context is not None and "attention on the codes" in c.description for c in built[1:])
    assert "own-kivi" in FlashCodecHarness(registry).tiers() and "own-kivi" not in FlashCodecHarness().tiers()
    assert TIERS == before and "own-kivi" not in TIERS
