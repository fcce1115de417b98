"""Materialization-free decode inside transformers: the attention-forward wrapper.

Evidence on the embedded model (64 greedy tokens): tokens equal the materialized path's on the
lossy int8 tiers and the unpatched model's on png lossless, with every decode step served on the
stored rows and no K/V view left. Mechanics (padding, GQA, Llama without q/k norms, fallbacks,
apply / remove) run on seeded random models built in memory.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import TOKEN_IDS, tiny_model  # noqa: E402
from flashcodec import CodecStream  # noqa: E402
from flashcodec.hf import (  # noqa: E402
    FlashCodecCache,
    apply_codec_attention,
    apply_flash_codec,
    get_flash_codec_patch,
    remove_codec_attention,
    remove_flash_codec,
)
from flashcodec.hf import codec_attention as ca  # noqa: E402
from flashcodec.hf.attention_choice import attending_on  # noqa: E402
from flashcodec.peak_memory import PeakMemory
from flashcodec.tiers import TIERS, tier  # noqa: E402
from kvspec import KVConfigError  # noqa: E402
from transformers import DynamicCache  # noqa: E402

NEW = 64
GREEDY = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
PROMPT = (
    "The os module provides a portable way of using operating system dependent functionality. "
    "If you just want to read or write a file see open(), if you want to manipulate paths, "
    "see the os.path module, and if you want to read all the lines in all the files on the "
    "command line see the fileinput module. For creating temporary files and directories see "
    "the tempfile module, and for high-level file and directory handling see the shutil module."
)


@pytest.fixture(scope="module")
def embedded(embedded_model):
    model, tokenizer = embedded_model
    return model, tokenizer(PROMPT, return_tensors="pt").input_ids


def tiny(kind="qwen3", seed=0, kv_heads=2):
    return tiny_model(kind, seed, kv_heads=kv_heads, **TOKEN_IDS)


def no_views(cache: FlashCodecCache) -> bool:
    return all(cache.layers[i].codec_cache.storage_bytes().view == 0 for i in cache.codec_layer_indices)


@pytest.mark.parametrize("name", [n for n in TIERS if TIERS[n].attention == "codes"])
def test_embedded_tokens_equal_the_materialized_path(embedded, name):
    """Every tier measured on its codes generates the tokens of its materialized view exactly."""
    model, ids = embedded
    tier_ = tier(name)
    materialized = model.generate(
        ids, cache=FlashCodecCache.from_config(model.config, codec=tier_.codec), **GREEDY
    )
    with attending_on(model, tier_.attention, backend="torch") as stats:
        cache = FlashCodecCache.from_config(model.config, codec=tier_.codec)
        coded = model.generate(ids, cache=cache, **GREEDY)
    assert ca.codec_attention_modules(model) == []  # removed on leaving the block
    layers = model.config.num_hidden_layers
    assert stats.coded == (NEW - 1) * layers  # every decode step of every layer took the coded path
    assert stats.chunked == layers and stats.fallbacks == {}  # the prefill too, chunk by chunk
    assert no_views(cache)
    assert torch.equal(coded, materialized)


def test_embedded_png_lossless_equals_the_unpatched_model(embedded):
    model, ids = embedded
    base = model.generate(ids, **GREEDY)
    apply_flash_codec(model, mode="png", block_size=8, keep_ratio=1.0, materialization_free=True)
    try:
        result = model.generate(ids, return_dict_in_generate=True, **GREEDY)
        assert isinstance(result.cache, FlashCodecCache) and no_views(result.cache)
        assert result.cache.get_seq_length() == ids.shape[1] + NEW - 1
    finally:
        remove_flash_codec(model)
    assert torch.equal(result.sequences, base)
    assert ca.codec_attention_modules(model) == []  # remove_flash_codec also removed the wrappers


@pytest.mark.parametrize(
    "kind, kv_heads", [("qwen3", 2), ("llama", 1), ("llama", 4)], ids=["qwen3-G2", "llama-G4", "llama-G1"]
)
def test_left_padded_batch_matches_the_unpatched_model(kind, kv_heads):
    model = tiny(kind, kv_heads=kv_heads)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3, 29), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :6], mask[2, :17] = 0, 0
    ids[mask == 0] = 0
    run = dict(attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    base = model.generate(ids, **run)
    stats = apply_codec_attention(model, backend="torch")
    try:
        out = model.generate(ids, cache=FlashCodecCache.from_config(model.config, mode="png"), **run)
    finally:
        remove_codec_attention(model)
    assert stats.coded == 23 * 2
    assert torch.equal(out, base)


def test_the_padding_mask_reaches_the_kernel(monkeypatch):
    # the same run with the mask dropped gives other tokens for the padded rows: the test above can fail
    model = tiny("qwen3")
    ids = torch.randint(3, 128, (2, 29), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    run = dict(attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    apply_codec_attention(model, backend="torch")
    try:
        good = model.generate(ids, cache=FlashCodecCache.from_config(model.config, mode="png"), **run)
        monkeypatch.setattr(ca, "_key_mask", lambda *args: (True, None))
        bad = model.generate(ids, cache=FlashCodecCache.from_config(model.config, mode="png"), **run)
    finally:
        remove_codec_attention(model)
    assert torch.equal(good[0], bad[0]) and not torch.equal(good[1], bad[1])


def test_decode_never_reads_the_view_after_the_prefill(monkeypatch):
    model = tiny("qwen3")
    ids = torch.randint(3, 128, (1, 21), generator=torch.Generator().manual_seed(2))
    cache = FlashCodecCache.from_config(model.config, mode="jpeg", keep_freqs=2, quant_bits=8)
    model(ids, cache=cache)  # prefill: builds and returns the view, as transformers needs it
    assert not no_views(cache)
    stats = apply_codec_attention(model, backend="torch")

    def refuse(self):
        raise AssertionError("a decode step read the reconstructed view")

    monkeypatch.setattr(CodecStream, "read", refuse)
    try:
        token = ids[:, -1:]
        for _ in range(12):  # crosses a block boundary: archiving happens without a read
            logits = model(token, cache=cache).logits
            token = logits[:, -1:].argmax(-1)
    finally:
        remove_codec_attention(model)
    assert stats.coded == 12 * 2 and no_views(cache)  # released on the first decode step
    assert cache.get_seq_length() == 33


def test_the_prefill_never_builds_a_view():
    model = tiny("qwen3")
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(2))
    tier = dict(mode="jpeg", keep_freqs=2, quant_bits=8)
    without = FlashCodecCache.from_config(model.config, **tier)
    with torch.no_grad():
        want = model(ids, cache=without, logits_to_keep=1).logits
    view_bytes = without.storage_bytes().view
    assert view_bytes > 0  # the plain backend keeps one view per layer
    cache = FlashCodecCache.from_config(model.config, **tier)
    stats = apply_codec_attention(model, backend="torch")
    try:
        with torch.no_grad(), PeakMemory() as tracker:  # no autograd graph keeping activations
            got = model(ids, cache=cache, logits_to_keep=1).logits
    finally:
        remove_codec_attention(model)
    assert stats.chunked == 2 and stats.fallbacks == {} and no_views(cache)
    assert tracker.current < view_bytes / 2, (tracker.current, view_bytes)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max() and cache.get_seq_length() == 200


def test_other_caches_and_training_take_the_base_implementation():
    model = tiny("qwen3")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    stats = apply_codec_attention(model, backend="torch")
    try:
        base = model.generate(ids, max_new_tokens=4, do_sample=False)  # DynamicCache: not coded
        assert stats.coded == 0 and stats.fallbacks["not a codec layer"] == 4 * 2
        model.train()
        cache = FlashCodecCache.from_config(model.config, mode="png")
        with torch.no_grad():
            model(ids, cache=cache)
            model(ids[:, :1], cache=cache)
        assert stats.coded == 0 and stats.fallbacks["training"] == 2 * 2  # prefill and step
        model.eval()
        with torch.no_grad():
            model(ids[:, :2], cache=cache)  # two new tokens, in eval: chunked on the codes
        assert stats.coded == 0 and stats.chunked == 1 * 2
    finally:
        model.eval()
        remove_codec_attention(model)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), base)


def test_apply_twice_and_remove_restore_the_attention_implementation():
    model = tiny("llama")
    before = model.config._attn_implementation
    apply_codec_attention(model)
    assert model.config._attn_implementation == ca.IMPLEMENTATION_PREFIX + before
    apply_codec_attention(model, backend="torch")  # replaces, never stacks
    assert model.config._attn_implementation == ca.IMPLEMENTATION_PREFIX + before
    assert ca.codec_attention_modules(model) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    attention = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    assert all(len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1 for m in attention)  # not two
    assert remove_codec_attention(model) == 2
    assert model.config._attn_implementation == before
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert remove_codec_attention(model) == 0
    other = tiny("llama", seed=1)
    assert other.config._attn_implementation == before  # other instances never touched


def test_models_outside_the_attention_interface_are_refused_unchanged():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(KVConfigError, match="attention interface"):
        apply_codec_attention(model)
    assert not model[0]._forward_pre_hooks and ca.codec_attention_modules(model) == []


def _tiny_hf(family: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, pad_token_id=0, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    "family, extra",
    [
        ("gemma2", dict(layer_types=["full_attention"] * 2, attn_logit_softcapping=0.5)),  # a cap that bites
        (
            "gpt_oss",
            dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2),
        ),  # sinks
    ],
    ids=["gemma2-softcap", "gpt_oss-sinks"],
)
def test_soft_capping_and_sink_logits_are_served_on_the_codes(family, extra):
    model = _tiny_hf(family, **extra)
    for layer in model.model.layers:  # logits and sink logits large enough to matter
        layer.self_attn.q_proj.weight.data *= 40
        if family == "gpt_oss":
            layer.self_attn.sinks.data.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(3, 128, (1, 26), generator=torch.Generator().manual_seed(5))

    def logits(cache) -> torch.Tensor:  # a 20-token prefill, then 6 single-token steps
        with torch.no_grad():
            steps = [model(ids[:, :20], cache=cache).logits[:, -1]]
            steps += [model(ids[:, i : i + 1], cache=cache).logits[:, -1] for i in range(20, 26)]
        return torch.stack(steps)

    want = logits(FlashCodecCache.from_config(model.config, mode="png"))  # materialized, lossless
    stats = apply_codec_attention(model, backend="torch")
    try:
        cache = FlashCodecCache.from_config(model.config, mode="png")
        got = logits(cache)
    finally:
        remove_codec_attention(model)
    assert stats.fallbacks == {} and stats.coded == 6 * 2 and stats.chunked == 2 and no_views(cache)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_bad_arguments_are_rejected_before_anything_changes():
    model = tiny("qwen3")
    with pytest.raises(KVConfigError, match="backend"):
        apply_codec_attention(model, backend="cuda")
    with pytest.raises(KVConfigError, match="materialization_free"):
        apply_flash_codec(model, mode="png", materialization_free="yes")
    with pytest.raises(KVConfigError, match=r"attention must be one of \('codes', 'materialized'\)"):
        apply_flash_codec(model, attention="mf")
    with pytest.raises(KVConfigError, match="disagree"):
        apply_flash_codec(model, attention="materialized", materialization_free=True)
    assert ca.codec_attention_modules(model) == [] and get_flash_codec_patch(model) is None


@pytest.mark.parametrize(
    "kwargs, on_codes",
    [
        ({}, True),  # the default tier is measured on its codes
        ({"attention": "materialized"}, False),
        (
            {"codec": TIERS["png-keep1"].codec},
            False,
        ),  # a chosen codec: a decoded view, as the reference has it
        ({"codec": TIERS["png-keep1"].codec, "attention": "codes"}, True),
        (
            {"mode": "jpeg", "keep_freqs": 2, "materialization_free": True},
            True,
        ),  # the reference's name for it
    ],
)
def test_apply_flash_codec_attends_where_attention_says(kwargs, on_codes):
    model = tiny("qwen3")
    apply_flash_codec(model, **kwargs)
    try:
        assert bool(ca.codec_attention_modules(model)) == on_codes
    finally:
        remove_flash_codec(model)
    assert ca.codec_attention_modules(model) == []


@pytest.mark.parametrize("attention", ["codes", "materialized"])
def test_attending_on_switches_for_the_block_only(attention):
    model = tiny("qwen3")
    with attending_on(model, attention) as stats:
        assert bool(ca.codec_attention_modules(model)) == (attention == "codes")
        assert (stats is None) == (attention == "materialized")
    assert ca.codec_attention_modules(model) == []
    with pytest.raises(KVConfigError, match="attention must be one of"):
        with attending_on(model, "mf"):
            pass


def test_a_dynamic_cache_step_after_coded_steps_is_untouched():
    # mixing caches across calls: each call decides on its own cache
    model = tiny("qwen3")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    apply_codec_attention(model)
    try:
        cache = DynamicCache(config=model.config)
        out = model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False)
    finally:
        remove_codec_attention(model)
    assert torch.equal(out, model.generate(ids, max_new_tokens=5, do_sample=False))


def test_bad_softcap_and_sinks_are_refused_with_what_is_allowed():
    from flashcodec import CodecKVCache
    from flashcodec.attention import codec_decode_attention, codec_prefill_attention

    cache = CodecKVCache(mode="png", block_size=8)
    k = torch.randn(1, 2, 20, 16)
    cache.update_and_fetch(k, k)
    query = torch.randn(1, 4, 1, 16)
    for bad, match in [
        (dict(softcap=0.0), "softcap must be None or a finite number > 0"),
        (dict(softcap=float("inf")), "softcap must be None or a finite number > 0"),
        (dict(sinks=torch.zeros(3)), r"one logit per query head \(4\)"),
        (dict(sinks=torch.zeros(4, dtype=torch.int64)), "floating tensor"),
        (dict(softcap=30.0, backend="triton"), "takes no softcap or sinks"),
    ]:
        with pytest.raises(KVConfigError, match=match):
            codec_decode_attention(query, cache.keys, cache.values, **bad)
    with pytest.raises(KVConfigError, match="softcap"):
        codec_prefill_attention(torch.randn(1, 4, 3, 16), cache.keys, cache.values, softcap=-1)
    assert cache.offset == 20  # only read, never changed
