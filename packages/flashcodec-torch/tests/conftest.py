"""Shared fixtures: small seeded signals, the codecs to test, one thread (the CI box has 2 shared cores)."""

from __future__ import annotations

import os

import pytest
import torch
from flashcodec import JPEGCodec, PNGCodec
from flashcodec.codecs import (
    ChannelInt4Codec,
    KIVICodec,
    MixedJPEGCodec,
    RotatedKIVICodec,
    ZeroPointJPEGCodec,
)
from flashcodec.tiers import TIERS
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still runs by default)")


# Property tests (test_properties.py): "ci" (the default) keeps the suite fast on a shared 2-core box;
# HYPOTHESIS_PROFILE=thorough runs many more random sequences when changing the cache itself.
settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def random_walk(b=2, h=3, s=64, d=16, *, seed=0, dtype=torch.float32, step=0.1) -> torch.Tensor:
    """Autocorrelated signal along the sequence axis: ``x_t = x_{t-1} + step * noise``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, 1, d, generator=g) + step * torch.randn(b, h, s, d, generator=g).cumsum(2)
    return x.to(dtype)


def gaussian(b=2, h=3, s=64, d=16, *, seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, s, d, generator=g).to(dtype)


@pytest.fixture
def walk():
    return random_walk()


#: the codec of every tier in flashcodec.tiers, plus the other formats the codecs offer, which no
#: tier uses (the benchmarks' study configurations, named as there, and two more): png with half
#: the deltas kept (Top-M pruning) and a mixed-bit jpeg with both row formats and a dropped
#: frequency (two row segments, int8 + packed int4)
CODECS = {name: t.codec for name, t in TIERS.items()}
CODECS.update(
    {
        "png-keep0.5": PNGCodec(8, keep_ratio=0.5),
        "jpeg-mixed-84": MixedJPEGCodec(8, freq_bits=(8, 8, 4, 4, 4, 4, 4, 0)),
        "jpeg-k8": JPEGCodec(8, keep_freqs=8),
        "jpeg-k4": JPEGCodec(8, keep_freqs=4),
        "jpeg-k8-int4": JPEGCodec(8, keep_freqs=8, quant_bits=4),
        "jpeg-k8-int4z": ZeroPointJPEGCodec(8),
        "jpeg-k8-int4z-w64": ZeroPointJPEGCodec(8, raw_window=64),
        "jpeg-k8-int4z-w96i8": ZeroPointJPEGCodec(8, raw_window=96, window_bits=8),
        "chan64-int4-w64i8": ChannelInt4Codec(64, raw_window=64, window_bits=8),
        "kivi64-k8v8-w64i8": KIVICodec(64, key_bits=8, value_bits=8),
        "kivi64-k4v4-w64i8": KIVICodec(64, key_bits=4, value_bits=4),
        "kivi64r-k4v4-w64i8": RotatedKIVICodec(64, key_bits=4, value_bits=4),
        "kivi64r-k3v3-w64i8": RotatedKIVICodec(64, key_bits=3, value_bits=3),
        "kivi64r-k3v2-w64i8": RotatedKIVICodec(64, key_bits=3, value_bits=2),
        "kivi64r-k3v2-w64i8-s8z4": RotatedKIVICodec(
            64, key_bits=3, value_bits=2, side_bits=8, value_zero_bits=4
        ),
        "kivi64r-k3v3-w0i8-s8": RotatedKIVICodec(64, key_bits=3, value_bits=3, raw_window=0, side_bits=8),
        "kivi64r-k3v2-w0i8-s8z4-vs1": RotatedKIVICodec(
            64, key_bits=3, value_bits=2, raw_window=0, side_bits=8, value_zero_bits=4, value_sink_tokens=1
        ),
    }
)


@pytest.fixture(scope="session")
def embedded_model():
    """The embedded tiny qwen3 (float32, eval) and its tokenizer, loaded once; skipped without kvbench."""
    from kvbench.models import embedded_model_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        path = embedded_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(path)


#: the special token ids of a tiny model that generates (pad for batches, eos to stop)
TOKEN_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_model(
    kind: str = "qwen3",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    layers: int = 2,
    kv_heads: int = 2,
    max_positions: int = 512,
    **config,
):
    """A random ``kind`` ("qwen3" or "llama") causal LM in eval mode: ``layers`` layers, hidden size 64,
    4 query / ``kv_heads`` KV heads of 16, vocabulary 128; the same weights for the same seed.
    ``config``: further fields of its transformers config, or other values for these (sliding
    windows, :data:`TOKEN_IDS`, another ``vocab_size``, ...).
    Needs transformers (imported here, so test files that skip without it can still import this module)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
    )
    common.update(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "qwen3":
            model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
        elif kind == "llama":
            model = LlamaForCausalLM(LlamaConfig(**common))
        else:
            raise ValueError(f"kind must be 'qwen3' or 'llama'; got {kind!r}")
    return model.eval().to(dtype)


def tiny_qwen3(seed: int = 0, dtype: torch.dtype = torch.float32, max_positions: int = 512):
    """A random 2-layer Qwen3 (4 query / 2 KV heads of 16), the same weights for the same seed."""
    return tiny_model("qwen3", seed, dtype, max_positions=max_positions)


def assert_same_generation_on_the_codes(codec):
    """Greedy generation (2 prompts of 70 tokens, 12 new) on :func:`tiny_qwen3` with a
    ``FlashCodecCache`` of ``codec``, once decoding then attending and once with attention on the
    codes; asserts both give the same tokens and logits (within 1e-4 of the largest) and that every
    decode step ran on the codes. Returns the cache of the run on the codes. Needs transformers."""
    pytest.importorskip("transformers")
    from flashcodec.hf import FlashCodecCache, apply_codec_attention, remove_codec_attention

    model = tiny_qwen3()
    ids = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(0))
    run = dict(
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    base = model.generate(ids, cache=FlashCodecCache.from_config(model.config, codec=codec), **run)
    stats = apply_codec_attention(model, backend="torch")
    try:
        cache = FlashCodecCache.from_config(model.config, codec=codec)
        coded = model.generate(ids, cache=cache, **run)
    finally:
        remove_codec_attention(model)
    assert stats.coded == 11 * 2 and stats.fallbacks == {}
    assert torch.equal(coded.sequences, base.sequences)
    for a, b in zip(coded.scores, base.scores, strict=True):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    return cache
