"""Evidence on the embedded model (the tiny trained Qwen3 in benchmarks/model/tiny-qwen3, found by kvbench).

The lossless tier (png keep=1.0) must reproduce the unpatched model's tokens exactly: greedy over
72 new tokens (several archived blocks per layer), with an explicit cache and with the hot patch,
and also beam search, sampling, assisted decoding and a crop-then-continue. The int8 jpeg tiers
must generate finite scores; their token match against the baseline is reported (printed with
``-s`` and recorded as a junit property), not asserted, since it is a property of the model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TOKEN_IDS, tiny_model

pytest.importorskip("transformers")

from flashcodec.hf import FlashCodecCache, apply_flash_codec, get_flash_codec_patch, remove_flash_codec  # noqa: E402
from flashcodec.tiers import TIERS  # noqa: E402
from kvbench.models import embedded_model_path  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

PROMPT = "The loop should not be running.\n\nThis is idempotent and"
NEW = 72  # > 64 new tokens, and prompt + NEW spans 11 blocks of 8 per layer
GREEDY = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
PNG = dict(mode="png", keep_ratio=1.0)


@pytest.fixture(scope="module")
def model():
    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def ids():
    return AutoTokenizer.from_pretrained(embedded_model_path())(PROMPT, return_tensors="pt").input_ids


@pytest.fixture(scope="module")
def baseline(model, ids):
    """The unpatched model's greedy continuation, [1, S + NEW] int64."""
    assert "generate" not in vars(model)
    return model.generate(ids, **GREEDY)


def test_png_lossless_explicit_cache_matches_greedy_tokens_exactly(model, ids, baseline):
    cache = FlashCodecCache.from_config(model.config, **PNG)
    out = model.generate(ids, cache=cache, **GREEDY)
    assert torch.equal(out, baseline)
    total = ids.shape[1] + NEW - 1  # the last token is sampled, never cached
    assert cache.get_seq_length() == total
    assert cache.codec_layer_indices == list(range(model.config.num_hidden_layers))
    assert all(layer.codec_cache.keys.n_blocks == total // 8 for layer in cache.layers)
    assert cache.storage_bytes().raw == sum(cache.storage_bytes(i).raw for i in cache.codec_layer_indices)


def test_png_lossless_hot_patch_matches_and_remove_restores(model, ids, baseline):
    apply_flash_codec(model, **PNG)
    try:
        patched = model.generate(ids, **GREEDY)
        assert get_flash_codec_patch(model).caches_built == 1
    finally:
        remove_flash_codec(model)
    assert torch.equal(patched, baseline)
    assert "generate" not in vars(model)
    assert torch.equal(model.generate(ids, **GREEDY), baseline)


def test_past_key_values_name_still_takes_the_cache(model, ids, baseline):
    cache = FlashCodecCache.from_config(model.config, **PNG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed to `cache` in recent 5.x
        out = model.generate(ids, past_key_values=cache, max_new_tokens=9, do_sample=False)
    assert cache.get_seq_length() == ids.shape[1] + 8
    assert torch.equal(out, baseline[:, : ids.shape[1] + 9])


def test_beam_search_png_exact(model, ids):
    kw = dict(num_beams=4, num_return_sequences=2, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    kw.update(return_dict_in_generate=True, output_scores=True)
    base = model.generate(ids, **kw)
    out = model.generate(ids, cache=FlashCodecCache.from_config(model.config, **PNG), **kw)
    assert torch.equal(out.sequences, base.sequences)
    assert torch.equal(out.sequences_scores, base.sequences_scores)


def test_sampling_png_exact(model, ids):
    kw = dict(do_sample=True, top_k=20, temperature=0.9, max_new_tokens=24, min_new_tokens=24)
    torch.manual_seed(1234)
    base = model.generate(ids, **kw)
    torch.manual_seed(1234)
    out = model.generate(ids, cache=FlashCodecCache.from_config(model.config, **PNG), **kw)
    assert torch.equal(out, base)


class RecordingCache(FlashCodecCache):
    """Records every crop ``generate`` asks for."""

    def crop(self, tokens_to_remove):
        self.crops = [*getattr(self, "crops", []), tokens_to_remove]
        super().crop(tokens_to_remove)


def test_assisted_decoding_png_exact(model, ids, baseline):
    # A random draft model is mostly wrong, so the main model's cache is cropped after each
    # rejected draft: greedy assisted decoding equals plain greedy only if those crops are exact.
    special = {name: getattr(model.config, name) for name in TOKEN_IDS}  # the model's, not the fixture's
    draft = tiny_model(layers=1, kv_heads=1, vocab_size=model.config.vocab_size, **special)
    cache = RecordingCache.from_config(model.config, **PNG)
    out = model.generate(
        ids, cache=cache, assistant_model=draft, max_new_tokens=24, min_new_tokens=24, do_sample=False
    )
    assert torch.equal(out, baseline[:, : ids.shape[1] + 24])
    assert any(n < 0 for n in cache.crops)  # drafts were rejected and rolled back


def test_crop_then_continue_png_exact(model, ids, baseline):
    cache = FlashCodecCache.from_config(model.config, **PNG)
    prefix = baseline[:, : ids.shape[1] + 20]
    with torch.no_grad():
        model(prefix, cache=cache)
    cache.crop(-11)  # cuts inside an archived block (38 -> 27 tokens)
    assert cache.get_seq_length() == prefix.shape[1] - 11
    # generate feeds only the uncached tail of `prefix`, then continues from the cropped cache
    out = model.generate(prefix, cache=cache, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(out, baseline[:, : prefix.shape[1] + 16])


@pytest.mark.parametrize(
    "tier, max_ratio",
    [(TIERS["jpeg-k8-int8"], 0.3), (TIERS["jpeg-k2-int8"], 0.1)],
    ids=["jpeg-k8-int8", "jpeg-k2-int8"],
)
def test_int8_tiers_generate_finite_and_report_token_match(
    model, ids, baseline, tier, max_ratio, record_property
):
    cache = FlashCodecCache.from_config(model.config, codec=tier.codec)
    out = model.generate(ids, cache=cache, return_dict_in_generate=True, output_logits=True, **GREEDY)
    # raw logits: the processed scores hold -inf on purpose (min_new_tokens masks EOS)
    assert len(out.logits) == NEW and all(bool(torch.isfinite(x).all()) for x in out.logits)
    new, ref = out.sequences[0, ids.shape[1] :], baseline[0, ids.shape[1] :]
    match = (new == ref).float().mean().item()
    record_property("token_match", match)
    print(
        f"\n{tier.name}: token match vs baseline {match:.3f} over {NEW} tokens, storage {cache.storage_bytes().ratio:.3f}"
    )
    assert new.shape == ref.shape
    assert cache.storage_bytes().ratio < max_ratio  # measured bytes held vs raw fp32 K/V


def test_per_layer_schedule_applies_to_named_layers_only(model, ids):
    per_layer = {0: {"keep_freqs": 2, "quant_bits": 8}, 5: {"mode": "png"}}
    apply_flash_codec(model, mode="jpeg", keep_freqs=8, per_layer=per_layer)
    try:
        out = model.generate(ids, return_dict_in_generate=True, max_new_tokens=8, do_sample=False)
    finally:
        remove_flash_codec(model)
    codecs = {i: layer.codec_cache.codec for i, layer in enumerate(out.cache.layers)}
    assert (codecs[0].mode, codecs[0].keep_freqs, codecs[0].quant_bits) == ("jpeg", 2, 8)
    assert codecs[5].mode == "png"
    for i in (1, 2, 3, 4):
        assert (codecs[i].mode, codecs[i].keep_freqs, codecs[i].quant_bits) == ("jpeg", 8, None)
    held = {i: out.cache.storage_bytes(i).held for i in out.cache.codec_layer_indices}
    assert held[0] < held[1] == held[2] == held[3] == held[4] < held[5]


def test_explicit_dynamic_cache_is_unaffected_by_the_patch(model, ids, baseline):
    apply_flash_codec(model, mode="jpeg", keep_freqs=2)
    try:
        out = model.generate(ids, cache=DynamicCache(config=model.config), **GREEDY)
        assert get_flash_codec_patch(model).caches_built == 0
    finally:
        remove_flash_codec(model)
    assert torch.equal(out, baseline)
