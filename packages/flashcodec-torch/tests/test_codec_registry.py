"""Codecs as objects, and the codec registry: a new codec is one class plus one registry line.

``RawCodec`` below is a whole codec written in this file (a block stored as its ``r`` rows,
synthesis matrix the identity). Registered with one line, it runs through ``CodecKVCache`` (both
forms, state round trip), coefficient-domain attention and the transformers cache with exact
results, and nothing else in the package knows about it.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass
from typing import ClassVar

import pytest
import torch
from conftest import gaussian
from flashcodec import CodecKVCache, JPEGCodec, PNGCodec
from flashcodec.attention import codec_decode_attention, materialized_decode_attention
from flashcodec.codecs import (
    CODECS,
    BlockCodec,
    ChannelInt4Codec,
    KIVICodec,
    MixedJPEGCodec,
    PartSpec,
    RotatedKIVICodec,
    TokenIntCodec,
    TurboQuantCodec,
    ZeroPointJPEGCodec,
    keyword_codec,
    make_codec,
)
from flashcodec.codecs.affine import TokenRows
from flashcodec.codecs.base import check_block_size, to_blocks
from kvspec import KVConfigError, KVDataError


@dataclass(frozen=True)
class RawCodec(TokenRows):
    """Stores each block's ``r`` tokens as they are: lossless. :class:`TokenRows`, the base of the
    codecs whose stored rows are the block's tokens, gives ``R = r``, the identity synthesis matrix
    and the decode from :meth:`stored_rows`."""

    mode: ClassVar[str] = "raw"

    block_size: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", check_block_size(self.block_size))

    @property
    def lossless(self) -> bool:
        return True

    def part_specs(self, dim: int) -> tuple[PartSpec, ...]:
        return (PartSpec("tokens", (self.block_size, dim), None),)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (to_blocks(x, self.block_size).clone(),)

    def stored_rows(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return parts[0].to(dtype)


@pytest.fixture
def raw_registered(monkeypatch):
    monkeypatch.setitem(CODECS, "raw", RawCodec)  # the one registry line


# ---------------------------------------------------------------- the registry
def test_every_registry_key_is_its_class_mode():
    registered = (JPEGCodec, PNGCodec, MixedJPEGCodec, ZeroPointJPEGCodec, ChannelInt4Codec, KIVICodec)
    assert list(CODECS.values()) == [*registered, TokenIntCodec, RotatedKIVICodec, TurboQuantCodec]
    assert all(cls.mode == mode and issubclass(cls, BlockCodec) for mode, cls in CODECS.items())


def test_an_unregistered_mode_names_the_registered_ones():
    with pytest.raises(
        KVConfigError,
        match=r"mode must be one of \('jpeg', 'png', 'jpeg-mixed', 'jpeg-int4z', 'chan-int4', 'kivi', 'token-int', 'kivi-rot', 'turboquant'\); got 'raw'",
    ):
        CodecKVCache(mode="raw", block_size=4)


def test_the_toy_codec_runs_through_the_cache_exactly(raw_registered):
    x = gaussian(s=23, dtype=torch.bfloat16)
    for cache in (CodecKVCache(mode="raw", block_size=4), CodecKVCache(codec=RawCodec(4))):
        assert cache.codec == RawCodec(4)
        for start, stop in ((0, 9), (9, 10), (10, 23)):
            k, v = cache.update_and_fetch(x[:, :, start:stop], -x[:, :, start:stop])
        assert torch.equal(k, x) and torch.equal(v, -x)
        assert cache.keys.n_blocks == 5 and cache.nbytes == cache.raw_nbytes
        twin = CodecKVCache.from_state(cache.state, cache.meta_state)  # meta_state: mode=raw, block_size=4
        assert twin.codec == RawCodec(4) and torch.equal(twin.read()[0], x)


@dataclass(frozen=True)
class BoundedRawCodec(RawCodec):
    """RawCodec that never stores a value above 100: it says so in its own part check."""

    mode: ClassVar[str] = "raw"

    def check_part(self, spec: PartSpec, part: torch.Tensor, *, check_finite: bool) -> None:
        super().check_part(spec, part, check_finite=check_finite)
        if bool((part.abs() > 100).any()):
            raise KVDataError(f"part {spec.name!r} holds a value above 100")


def test_a_restored_state_is_checked_by_the_codec_itself(monkeypatch):
    monkeypatch.setitem(CODECS, "raw", BoundedRawCodec)
    cache = CodecKVCache(codec=BoundedRawCodec(4))
    x = gaussian(s=9)
    cache.update_and_fetch(x, x)
    state = list(cache.state)
    assert CodecKVCache.from_state(state, cache.meta_state).offset == 9
    state[2] = state[2] * 1000  # the values' blocks
    with pytest.raises(KVDataError, match="values part 'tokens' holds a value above 100"):
        CodecKVCache.from_state(state, cache.meta_state)


def test_the_toy_codec_needs_no_attention_code(raw_registered):
    g = torch.Generator().manual_seed(0)
    cache = CodecKVCache(codec=RawCodec(4))
    cache.append(torch.randn(2, 2, 27, 16, generator=g), torch.randn(2, 2, 27, 16, generator=g))
    query = torch.randn(2, 4, 1, 16, generator=g)
    coded = codec_decode_attention(query, cache.keys, cache.values, backend="torch", blocks_per_split=2)
    want = materialized_decode_attention(query, cache.keys, cache.values)
    assert torch.allclose(coded, want, atol=1e-6, rtol=0)


def test_the_toy_codec_runs_in_the_transformers_cache_and_generate_is_exact(raw_registered):
    pytest.importorskip("transformers")
    from flashcodec.hf import FlashCodecCache
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    ids = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(1))
    greedy = dict(max_new_tokens=14, min_new_tokens=14, do_sample=False)
    base = model.generate(ids, **greedy)
    cache = FlashCodecCache.from_config(
        config, codec=RawCodec(4), per_layer={1: {"mode": "raw", "block_size": 2}}
    )
    out = model.generate(ids, cache=cache, **greedy)
    assert torch.equal(out, base)
    codecs = [layer.codec_cache.codec for layer in cache.layers]
    assert codecs == [RawCodec(4), RawCodec(2)] and cache.layers[0].codec_cache.keys.n_blocks == 6


# ---------------------------------------------------------------- codec objects
def test_codecs_are_frozen_validated_values():
    codec = JPEGCodec(block_size=8, keep_freqs=2, quant_bits=8)
    assert codec == JPEGCodec(8, 2, 8) and hash(codec) == hash(JPEGCodec(8, 2, 8))
    assert JPEGCodec(8) == JPEGCodec(8, keep_freqs=8)  # keep_freqs=None resolves to r
    assert PNGCodec(delta_dtype="float64") == PNGCodec(delta_dtype=torch.float64) == PNGCodec()
    assert repr(codec) == "JPEGCodec(block_size=8, keep_freqs=2, quant_bits=8)"
    assert len({JPEGCodec(8, 2), JPEGCodec(8, 2), PNGCodec(8)}) == 2
    with pytest.raises(FrozenInstanceError):
        codec.keep_freqs = 4


@pytest.mark.parametrize(
    "codec", [JPEGCodec(8, 2, 8), JPEGCodec(4), PNGCodec(8, keep_ratio=0.5, delta_dtype="float32")], ids=repr
)
def test_config_rebuilds_the_codec_and_the_keyword_form_builds_the_same_object(codec):
    assert make_codec(**codec.config()) == codec
    keywords = {k: v for k, v in codec.config().items()}
    assert CodecKVCache(**keywords).codec == codec


# every registered codec with options away from its defaults: the keyword form takes any field
KEYWORD_CASES = [
    JPEGCodec(8, keep_freqs=2, quant_bits=8),
    PNGCodec(4, keep_ratio=0.5, delta_dtype="float32"),
    MixedJPEGCodec(8, freq_bits=(8, 4, 4, 4, 0, 0, 0, 0)),
    ZeroPointJPEGCodec(8, raw_window=96, window_bits=8),
    ChannelInt4Codec(64, raw_window=64, window_bits=8),
    KIVICodec(64, key_bits=8, value_bits=8),
]


@pytest.mark.parametrize("codec", KEYWORD_CASES, ids=lambda c: c.mode)
def test_every_entry_point_builds_every_codec_from_the_keyword_form(codec):
    from flashcodec.hf import FlashCodecCache

    keywords = codec.config()
    assert keyword_codec(**keywords) == codec
    assert CodecKVCache(**keywords).codec == codec
    assert FlashCodecCache(**keywords).codec_defaults["codec"] == codec


def test_the_keyword_form_by_position_names_mode_block_size_keep_freqs_keep_ratio_quant_bits():
    assert CodecKVCache("jpeg", 8, 2, 1.0, 8).codec == JPEGCodec(8, keep_freqs=2, quant_bits=8)
    assert CodecKVCache("png", 4, delta_dtype="float32").codec == PNGCodec(4, delta_dtype=torch.float32)
    assert CodecKVCache().codec == JPEGCodec(8)
    with pytest.raises(KVConfigError, match=r"at most 5 positional values.*got 6"):
        CodecKVCache("jpeg", 8, 2, 1.0, 8, 0)
    with pytest.raises(KVConfigError, match=r"mode is given twice.*mode='png'"):
        keyword_codec("jpeg", mode="png")
    with pytest.raises(KVConfigError, match=r"unknown codec option 'keep_freqz'"):
        CodecKVCache(keep_freqz=2)


def test_keyword_form_options_of_another_codec_are_refused_unless_at_their_default():
    assert make_codec("jpeg", keep_ratio=1.0, delta_dtype=None) == JPEGCodec()
    assert make_codec("png", keep_freqs=None, quant_bits=None) == PNGCodec()
    with pytest.raises(KVConfigError, match=r"keep_ratio applies to mode='png' only; got keep_ratio=0\.5"):
        make_codec("jpeg", keep_ratio=0.5)
    with pytest.raises(KVConfigError, match=r"unknown codec option 'keep_freqz'.*takes \['block_size'"):
        make_codec("jpeg", keep_freqz=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(codec=JPEGCodec(), mode="jpeg"), r"either codec= or the keyword form.*mode='jpeg'"),
        (dict(codec=PNGCodec(), keep_freqs=2), r"not both.*keep_freqs=2"),
        (dict(codec=PNGCodec(), delta_dtype="float32"), r"not both.*delta_dtype='float32'"),
        (dict(codec={"mode": "jpeg"}), r"codec must be a codec object.*got \{'mode': 'jpeg'\}"),
        (dict(codec="jpeg"), r"codec must be a codec object.*got 'jpeg'"),
    ],
    ids=["codec-and-mode", "codec-and-keep-freqs", "codec-and-delta-dtype", "dict", "str"],
)
def test_codec_and_the_keyword_form_are_not_mixed(kwargs, match):
    with pytest.raises(KVConfigError, match=match):
        CodecKVCache(**kwargs)


def test_codec_keyword_with_cache_options():
    cache = CodecKVCache(codec=PNGCodec(4), check_finite=False, initial_blocks=2)
    assert (cache.codec, cache.check_finite, cache.initial_blocks) == (PNGCodec(4), False, 2)
