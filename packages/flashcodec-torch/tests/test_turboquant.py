"""TurboQuantCodec: TurboQuant's MSE quantizer (norm + Lloyd-Max codes after a random rotation)."""

from __future__ import annotations

import math

import pytest
import torch
from flashcodec import CodecKVCache
from flashcodec.attention import (
    codec_decode_attention,
    codec_prefill_attention,
    coded_rows,
    materialized_decode_attention,
    materialized_prefill_attention,
)
from flashcodec.codecs import CODECS, make_codec
from flashcodec.codecs.turboquant import (
    TurboQuantCodec,
    lloyd_max_codebook,
    lloyd_max_mse,
    random_rotation,
)
from flashcodec.kernels.naive import decode_attention_naive
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError

#: Max (1960), Table I: the positive output levels of the Lloyd-Max quantizer of N(0, 1)
MAX_1960 = {
    1: (0.7979,),
    2: (0.4528, 1.510),
    3: (0.2451, 0.7560, 1.344, 2.152),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733),
}


def unit_vectors(n: int, d: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True)).float()


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_is_lloyd_max(bits):
    c, t = lloyd_max_codebook(bits)
    assert c.dtype == torch.float64 and c.shape == (2**bits,) and t.shape == (2**bits - 1,)
    assert bool((c[1:] > c[:-1]).all()) and torch.equal(c, -c.flip(0))
    # nearest neighbour: every boundary is the midpoint of its two centroids
    assert torch.allclose(t, (c[1:] + c[:-1]) / 2, atol=0, rtol=0)
    # centroid condition, integrated independently (Simpson's rule on each cell): the mean of N(0, 1) over it
    edges = [-12.0, *t.tolist(), 12.0]
    for i in range(2**bits):
        x = torch.linspace(edges[i], edges[i + 1], 20_001, dtype=torch.float64)
        pdf = torch.exp(-x * x / 2)
        w = torch.ones_like(x)
        w[1:-1:2], w[2:-1:2] = 4, 2
        mean = float((w * x * pdf).sum() / (w * pdf).sum())
        assert mean == pytest.approx(float(c[i]), abs=1e-9)
    # and the published table
    assert c[2 ** (bits - 1) :].tolist() == pytest.approx(MAX_1960[bits], abs=6e-4)


def test_codebook_distortion_is_the_papers():
    """TurboQuant's D_mse for a unit vector: about 0.36, 0.117, 0.03, 0.009 at 1 to 4 bits, each
    under the paper's upper bound sqrt(3) pi / 2 * 4**-b."""
    got = [lloyd_max_mse(b) for b in (1, 2, 3, 4)]
    assert got == pytest.approx([0.3634, 0.1175, 0.03455, 0.009501], rel=2e-3)
    for b, mse in zip((1, 2, 3, 4), got, strict=True):
        assert mse < math.sqrt(3) * math.pi / 2 * 4.0**-b


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim", [64, 128])
def test_unit_vector_distortion_is_the_codebooks(bits, dim):
    """Coded through the codec (fp16 norms, fp16 codebook values), random unit vectors lose what
    the Gaussian codebook predicts: the rotated coordinates are close to N(0, 1/D)."""
    codec = TurboQuantCodec(block_size=8, bits=bits)
    x = unit_vectors(4096, dim).reshape(8, 512, dim)
    err = (codec.roundtrip(x) - x).pow(2).sum(-1).mean()
    assert float(err) == pytest.approx(lloyd_max_mse(bits), rel=0.06)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_a_spiky_vector_is_coded_as_well_as_a_random_one(bits):
    """The rotation is data-free but random: a token with all its energy in one channel (a key's
    outlier channel) meets the same coordinate law, so the same distortion (a sign-flip Hadamard
    rotation would give it D coordinates of equal size, which the 3-bit codebook codes with 1.7x the error)."""
    dim = 64
    codec = TurboQuantCodec(block_size=8, bits=bits)
    spikes = torch.eye(dim).repeat(8, 1).reshape(8, dim, dim) * torch.linspace(0.5, 40, 8)[:, None, None]
    err = ((codec.roundtrip(spikes) - spikes).pow(2).sum(-1) / spikes.pow(2).sum(-1)).mean()
    assert float(err) == pytest.approx(lloyd_max_mse(bits), rel=0.15)


def test_rotation_is_orthogonal_seeded_and_a_copy():
    m = random_rotation(64, seed=3)
    assert torch.allclose(m @ m.T, torch.eye(64), atol=1e-5)
    assert torch.equal(m, random_rotation(64, seed=3)) and not torch.equal(m, random_rotation(64, seed=4))
    m.zero_()
    assert random_rotation(64, seed=3).abs().sum() > 0
    codec = TurboQuantCodec(seed=3)
    assert torch.equal(codec.channel_rotation(64), random_rotation(64, seed=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("bits", "width"), [(2, 16), (3, 24), (4, 32)])
def test_round_trip_shapes_dtypes_and_zero_tokens(dtype, bits, width):
    codec = TurboQuantCodec(block_size=4, bits=bits)
    x = torch.randn(2, 3, 12, 64, generator=torch.Generator().manual_seed(0)).mul(5).to(dtype)
    x[1, 2, 5] = 0
    parts = codec.encode(x)
    assert [p.shape for p in parts] == [(2, 3, 3, 4, width), (2, 3, 3, 4, 1)]
    assert [p.dtype for p in parts] == [spec.dtype for spec in codec.part_specs(64)]
    assert [tuple(p.shape[3:]) for p in parts] == [spec.shape for spec in codec.part_specs(64)]
    y = codec.decode(parts, dtype)
    assert y.shape == x.shape and y.dtype == dtype
    assert not y[1, 2, 5].any()
    rel = (y.float() - x.float()).pow(2).sum(-1) / x.float().pow(2).sum(-1).clamp_min(1e-12)
    rel[1, 2, 5] = 0
    assert float(rel.mean()) < 1.5 * lloyd_max_mse(bits)
    # the norm is kept: the reconstruction's length is the coded unit vector's times |x|
    assert torch.allclose(parts[1][..., 0].float(), x.float().norm(dim=-1).reshape(2, 3, 3, 4), rtol=1e-3)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bytes_held_are_the_codes_and_norms(bits):
    b, h, s, d, r = 1, 2, 16 * 3 + 5, 64, 16
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(b, h, s, d, generator=g).bfloat16() for _ in range(2))
    cache = CodecKVCache(codec=TurboQuantCodec(block_size=r, bits=bits))
    cache.append(k, v)
    st = cache.storage_bytes()
    assert st.held == sum(t.nbytes for t in cache.state)
    # 3 archived blocks: bits * D / 8 bytes of codes and a 2-byte norm a token, keys and values
    assert st.used == 2 * b * h * 3 * r * (bits * d // 8 + 2)
    assert st.tail == 2 * b * h * 5 * d * 2  # the incomplete block, raw bf16
    assert TurboQuantCodec(bits=bits).storage_ratio(64, torch.bfloat16) == (bits * 64 / 8 + 2) / 128


@pytest.mark.parametrize("bits", [3, 4])
def test_attention_on_the_codes_equals_decode_then_attend(bits):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 16 * 5 + 7, 64, generator=g), torch.randn(2, 2, 16 * 5 + 7, 64, generator=g)
    k[..., 3] += 8  # an outlier channel
    cache = CodecKVCache(codec=TurboQuantCodec(block_size=16, bits=bits))
    cache.append(k, v)
    q = torch.randn(2, 4, 1, 64, generator=g)
    got = codec_decode_attention(q, cache.keys, cache.values, backend="torch")
    assert not cache.keys.has_view and not cache.values.has_view
    want = materialized_decode_attention(q, cache.keys, cache.values)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    qs = torch.randn(2, 4, 5, 64, generator=g)
    got = codec_prefill_attention(qs, cache.keys, cache.values)
    want = materialized_prefill_attention(qs, cache.keys, cache.values)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # the check above needs the rotation: attended as if unrotated, the archive gives another output
    keys, values = coded_rows(cache.keys), coded_rows(cache.values)
    right = decode_attention_naive(q[:, :, 0], keys, values)
    wrong = decode_attention_naive(q[:, :, 0], keys._replace(rotation=None), values._replace(rotation=None))
    assert (right - wrong).abs().max() > 0.1 * right.abs().max()


def test_state_round_trip_and_refusals():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 40, 32, generator=g).half(), torch.randn(1, 2, 40, 32, generator=g).half()
    codec = TurboQuantCodec(block_size=8, bits=3, seed=7)
    cache = CodecKVCache(codec=codec)
    cache.append(k, v)
    again = CodecKVCache.from_state(cache.state, cache.meta_state)
    assert again.codec == codec
    assert all(torch.equal(a, b) for a, b in zip(cache.state, again.state, strict=True))
    state = list(cache.state)
    n = len(codec.stream_state_specs(1))
    norms = state[n + 1].clone()
    norms[0, 0, 0, 0, 0] = -1.0
    state[n + 1] = norms
    with pytest.raises(KVDataError, match="'norms'"):
        CodecKVCache.from_state(tuple(state), cache.meta_state)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"bits": 5}, KVConfigError, r"bits must be one of \(2, 3, 4\)"),
        ({"bits": 1}, KVConfigError, "bits must be one of"),
        ({"bits": True}, KVConfigError, "bits must be one of"),
        ({"seed": -1}, KVConfigError, "seed must be an integer >= 0"),
        ({"block_size": 0}, KVConfigError, "block_size"),
        ({"window_bits": 4}, KVConfigError, "window_bits"),
    ],
)
def test_bad_options(options, error, match):
    with pytest.raises(error, match=match):
        TurboQuantCodec(**options)


def test_bad_inputs():
    with pytest.raises(KVShapeError, match="multiple of 8; got D=60"):
        TurboQuantCodec(block_size=4, bits=3).encode(torch.randn(1, 1, 4, 60))
    with pytest.raises(KVShapeError, match="multiple of 4; got D=62"):
        CodecKVCache(codec=TurboQuantCodec(bits=2)).append(torch.randn(1, 1, 9, 62), torch.randn(1, 1, 9, 62))
    with pytest.raises(KVDtypeError):
        TurboQuantCodec(block_size=4).encode(torch.ones(1, 1, 4, 8, dtype=torch.int32))
    with pytest.raises(KVConfigError, match="keep_freqs applies to mode="):
        make_codec("turboquant", keep_freqs=3)


def test_registered():
    assert CODECS["turboquant"] is TurboQuantCodec
    assert make_codec("turboquant", bits=3, block_size=4) == TurboQuantCodec(4, 3)
    assert make_codec(**TurboQuantCodec(4, 2, seed=9).config()) == TurboQuantCodec(4, 2, seed=9)


def test_a_tiny_model_generates_on_the_codes():
    """FlashCodecCache on a tiny random Qwen3: attention on the codes gives the same tokens and
    logits as decoding then attending, and the cache holds only codes, norms and the short tail."""
    from conftest import assert_same_generation_on_the_codes

    cache = assert_same_generation_on_the_codes(TurboQuantCodec(block_size=16, bits=4))
    # 81 tokens cached: 5 blocks of 16 coded (16 + 2 bytes a token and head), 1 token raw (fp32)
    st = cache.storage_bytes()
    layers, heads, dim = 2, 2, 16
    assert st.used == layers * 2 * 2 * heads * 5 * 16 * (dim // 2 + 2)
    assert st.tail == layers * 2 * 2 * heads * 1 * dim * 4
    assert st.view == 0


def test_compare_runs_turboquant_as_a_peer_on_the_codes():
    pytest.importorskip("kvbench")
    from conftest import tiny_qwen3
    from flashcodec.compare import CODEC_PEERS, FlashCodecHarness, build_candidates

    model = tiny_qwen3()
    candidates, absent = build_candidates(model, [], ["turboquant-4", "turboquant-3"])
    assert absent == []
    peers = {c.name: c for c in candidates if c.kind == "peer"}
    assert set(peers) == {"turboquant-4", "turboquant-3"}
    for name, cand in peers.items():
        assert "attention on the codes" in cand.description and "MSE variant" in cand.description
        assert cand.context is not None
        assert cand.config["codec"] == repr(CODEC_PEERS[name]) and cand.config["attention"] == "codes"
        assert type(cand.make_cache()).__name__ == "FlashCodecCache"
    assert CODEC_PEERS["turboquant-3"].bits == 3
    assert {"turboquant-4", "turboquant-3", "hf-quanto-q4", "hf-quanto-q2"} <= set(
        FlashCodecHarness().peers()
    )
