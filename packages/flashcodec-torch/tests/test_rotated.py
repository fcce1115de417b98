"""RotatedKIVICodec: KIVI's codes of 2 to 8 bits after a fixed Hadamard rotation of the channels."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
from flashcodec.codecs import KIVICodec, TokenIntCodec
from flashcodec.codecs.rotated import (
    RotatedKIVICodec,
    RotatedTokenIntCodec,
    dequantize_bits,
    hadamard_rotation,
    pack_codes,
    quantize_bits,
    unpack_codes,
)
from flashcodec.kernels.naive import decode_attention_naive, decoded_chunk, in_rotated_domain
from kvspec import KVConfigError, KVDataError, KVShapeError


def kv(b=2, h=2, s=203, d=16, seed=0, dtype=torch.float32):
    """Keys with two outlier channels and a distinct first token (a sink); values with a large
    entry in a few channels of every token (what a rotation spreads out)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, s, d, generator=g)
    k[..., 3] = 8 + 4 * k[..., 3]
    k[..., 7] *= 6
    k[:, :, 0] = 5 * torch.randn(b, h, d, generator=g)
    v = torch.randn(b, h, s, d, generator=g) * torch.rand(b, h, s, 1, generator=g).mul(4).add(0.1)
    v[..., 1] *= 10
    return k.to(dtype), v.to(dtype)


def test_rotation_is_orthonormal_seeded_and_a_copy():
    m = hadamard_rotation(64, seed=3)
    assert m.dtype == torch.float32 and m.shape == (64, 64)
    assert torch.allclose(m @ m.T, torch.eye(64), atol=1e-6)
    assert torch.equal(m, hadamard_rotation(64, seed=3))
    assert not torch.equal(m, hadamard_rotation(64, seed=4))  # other random signs
    m.zero_()  # a caller's copy: the cached rotation is untouched
    assert torch.equal(hadamard_rotation(64, seed=3) @ hadamard_rotation(64, seed=3).T, torch.eye(64))


@pytest.mark.parametrize("bits,lo,hi,width", [(2, -2, 1, 8), (3, -4, 3, 12)])
def test_packed_codes_round_trip_every_value(bits, lo, hi, width):
    q = torch.randint(lo, hi + 1, (3, 5, 32), generator=torch.Generator().manual_seed(0))
    q[0, 0, :8] = torch.tensor([lo, hi] * 4)
    packed = pack_codes(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, width)
    assert torch.equal(unpack_codes(packed, bits, 32).long(), q)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [-1, -2])
def test_quantize_bits_is_within_half_a_step(bits, dim):
    x = torch.randn(3, 5, 8, 16) * torch.rand(3, 5, 8, 1) * 10
    codes, scale, zero = quantize_bits(x, bits, dim)
    back = dequantize_bits(codes, scale, zero, bits, 16)
    assert ((back - x).abs() <= scale.float() / 2 * (1 + 1e-3) + 1e-6).all()
    # fewer bits, larger steps
    if bits < 8:
        finer = quantize_bits(x, {2: 3, 3: 4, 4: 8}[bits], dim)[1].float()
        assert (finer <= scale.float()).all()


def test_unrotated_four_and_eight_bits_are_kivi_bit_for_bit():
    k, v = kv(s=192)
    for kb, vb in ((4, 4), (8, 4), (4, 8)):
        ours = RotatedKIVICodec(64, kb, vb, rotate_keys=False, rotate_values=False)
        theirs = KIVICodec(64, kb, vb)
        assert all(
            torch.equal(a, b)
            for a, b in zip(ours.encode_blocks(k, 0), theirs.encode_blocks(k, 0), strict=True)
        )
        mine, kivi = ours.value_codec.encode(v), TokenIntCodec(64, vb, 64, 8).encode(v)
        assert all(torch.equal(a, b) for a, b in zip(mine, kivi, strict=True))


def test_gauss_fit_beats_min_max_at_two_bits_on_gaussian_slices():
    x = torch.randn(4, 8, 64, 64, generator=torch.Generator().manual_seed(0)) + 3
    for dim in (-1, -2):
        errs = {}
        for fit in ("minmax", "gauss"):
            codes, scale, zero = quantize_bits(x, 2, dim, fit=fit)
            errs[fit] = (dequantize_bits(codes, scale, zero, 2, 64) - x).norm() / x.norm()
        assert errs["gauss"] < 0.85 * errs["minmax"]
    # the levels sit symmetrically about the mean: mean-centred data averages back to its mean
    codes, scale, zero = quantize_bits(x, 2, -1, fit="gauss")
    back = dequantize_bits(codes, scale, zero, 2, 64)
    assert (back.mean(-1) - x.mean(-1)).abs().max() < 0.25 * x.std()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_round_trip_error_falls_with_bits_and_rotation_helps_spiky_values(bits):
    _, v = kv(s=192)
    rotated = RotatedTokenIntCodec(64, bits).roundtrip(v)
    plain = RotatedTokenIntCodec(64, bits, rotate=False).roundtrip(v)
    err_rot = ((rotated - v).norm() / v.norm()).item()
    err_plain = ((plain - v).norm() / v.norm()).item()
    assert 0 < err_rot < {2: 0.35, 3: 0.15, 4: 0.07, 8: 0.004}[bits]
    assert err_rot < 0.8 * err_plain  # one large channel per token: rotation spreads it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_sink_keeps_the_first_key_to_fp16_rounding(dtype):
    k, v = kv(dtype=dtype)
    codec = RotatedKIVICodec(16, 2, 2, raw_window=16)
    keys, _ = CodecKVCache(codec=codec).update_and_fetch(k, v)
    err = (keys.float() - k.float()).abs().amax(-1)  # [B, H, S]
    first = err[:, :, 0]
    # token 0 is the fp16 zero point of block 0 (rotated), back in fp32: fp16 / bf16 rounding only
    assert (first <= 4e-3 * k[:, :, 0].float().abs().amax(-1)).all()
    assert (first < 0.05 * err[:, :, 1:16].mean(-1)).all()
    off, _ = CodecKVCache(codec=RotatedKIVICodec(16, 2, 2, raw_window=16, exact_sink=False)).update_and_fetch(
        k, v
    )
    assert ((off.float() - k.float()).abs().amax(-1)[:, :, 0] > 10 * first).all()


def test_storage_is_measured_from_the_arrays():
    k, v = kv(b=1, h=2, s=64 * 3 + 70, d=64, dtype=torch.bfloat16)
    cache = CodecKVCache(codec=RotatedKIVICodec(64, key_bits=3, value_bits=2))
    cache.append(k, v)
    st = cache.storage_bytes()
    assert st.held == sum(t.nbytes for t in cache.state)
    # 3 archived blocks: 3-bit keys (24 bytes a token) and 2-bit values (16), fp16 pairs per side
    key_block, value_block = 64 * 24 + 64 * 4, 64 * 16 + 64 * 4
    assert st.used == 2 * 3 * (key_block + value_block)
    assert st.tail == 2 * 2 * 70 * (64 + 8)  # the int8 window, unrotated


CONFIGS = {
    "k4v4": RotatedKIVICodec(64),
    "k8v8": RotatedKIVICodec(64, 8, 8),
    "k3v3": RotatedKIVICodec(64, 3, 3),
    "k4v2": RotatedKIVICodec(64, 4, 2),
    "k2v2-keys-only": RotatedKIVICodec(64, 2, 2, rotate_values=False),
    "k2v2-gauss": RotatedKIVICodec(64, 2, 2, range_fit="gauss"),
    "k4v4-values-only-raw-tail": RotatedKIVICodec(64, rotate_keys=False, window_bits=None),
    "k4v4-r16-w0": RotatedKIVICodec(16, raw_window=0, window_bits=None),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("groups", [1, 3])
def test_attention_on_the_codes_equals_decode_then_attend(name, groups):
    k, v = kv(b=2, h=2, s=64 * 3 + 77, d=64)
    cache = CodecKVCache(codec=CONFIGS[name])
    cache.append(k, v)
    q = torch.randn(2, 2 * groups, 1, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, cache.offset, dtype=torch.bool)
    mask[1, :40] = False  # a left-padded row
    for key_mask in (None, mask):
        got = codec_decode_attention(q, cache.keys, cache.values, key_mask=key_mask, backend="torch")
        assert not cache.keys.has_view and not cache.values.has_view
        want = materialized_decode_attention(q, cache.keys, cache.values, key_mask=key_mask)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        cache.keys.release_view(), cache.values.release_view()
    qs = torch.randn(2, 2 * groups, 5, 64, generator=torch.Generator().manual_seed(2))
    got = codec_prefill_attention(qs, cache.keys, cache.values)
    want = materialized_prefill_attention(qs, cache.keys, cache.values)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_attention_on_the_codes_is_not_the_unrotated_attention():
    """The check above would pass vacuously if the rotation were lost on both sides: the archived
    rows must be rotated, and attending them as if they were not must give another output."""
    k, v = kv(b=1, h=2, s=64 * 3, d=64)
    cache = CodecKVCache(codec=CONFIGS["k4v4"])
    cache.append(k, v)
    q = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(1))
    keys, values = coded_rows(cache.keys), coded_rows(cache.values)
    assert keys.rotation is not None and values.rotation is not None
    right = decode_attention_naive(q, keys, values)
    wrong = decode_attention_naive(q, keys._replace(rotation=None), values._replace(rotation=None))
    assert (right - wrong).abs().max() > 0.1 * right.abs().max()
    # the decoded chunk is the tokens rotated back: what the materialized view holds
    assert torch.allclose(decoded_chunk(keys, 0, keys.n_blocks), cache.keys.read()[:, :, :128], atol=1e-5)


def test_in_rotated_domain_gives_the_same_attention():
    k, v = kv(b=2, h=2, s=64 * 2 + 70, d=64, dtype=torch.bfloat16)
    cache = CodecKVCache(codec=CONFIGS["k3v3"])
    cache.append(k, v)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    keys, values = coded_rows(cache.keys), coded_rows(cache.values)
    want = decode_attention_naive(q, keys, values)
    q2, keys2, values2, back = in_rotated_domain(q, keys, values)
    assert keys2.rotation is None and values2.rotation is None
    got = back(decode_attention_naive(q2, keys2, values2))
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
    plain = CodecKVCache(codec=KIVICodec(64))
    plain.append(k, v)
    pk, pv = coded_rows(plain.keys), coded_rows(plain.values)
    q3, k3, v3, _ = in_rotated_domain(q, pk, pv)
    assert q3 is q and k3 is pk and v3 is pv  # nothing rotated: passed through


def test_state_round_trip_and_refusals():
    k, v = kv(s=150, d=32, dtype=torch.bfloat16)
    codec = RotatedKIVICodec(32, key_bits=3, value_bits=2, raw_window=20, seed=5, range_fit="gauss")
    cache = CodecKVCache(codec=codec)
    cache.append(k, v)
    again = CodecKVCache.from_state(cache.state, cache.meta_state)
    assert again.codec == codec and again.values.codec == codec.value_codec
    assert all(torch.equal(a, b) for a, b in zip(cache.state, again.state, strict=True))
    more_k, more_v = kv(s=40, d=32, seed=3, dtype=torch.bfloat16)
    a, b = cache.update_and_fetch(more_k, more_v), again.update_and_fetch(more_k, more_v)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # 3-bit key codes where 2-bit value codes belong: the widths differ, the check names the part
    n = len(codec.stream_state_specs(1))
    keys_twice = (*cache.state[:n], *cache.state[:n])
    with pytest.raises(KVDataError, match="values part 'codes'"):
        CodecKVCache.from_state(keys_twice, cache.meta_state)


def test_a_head_dim_that_is_not_a_power_of_two_gets_a_random_orthogonal_rotation():
    # head sizes such as 80 or 96 have no Hadamard matrix: a seeded random orthogonal one instead
    for dim in (24, 80, 96):
        m = hadamard_rotation(dim, seed=3)
        torch.testing.assert_close(m @ m.T, torch.eye(dim), atol=1e-5, rtol=0)
        assert torch.equal(m, hadamard_rotation(dim, seed=3)) and not torch.equal(
            m, hadamard_rotation(dim, seed=4)
        )
    cache = CodecKVCache(codec=RotatedKIVICodec(8, 8, 8, raw_window=0))
    x = torch.randn(1, 1, 24, 24)
    cache.append(x, x)
    assert cache.storage_bytes().tail == 0  # every token went through the rotation into blocks
    keys, values = cache.read()
    assert keys.shape == x.shape and (keys.float() - x).abs().max() < 0.05 * x.abs().max()
    with pytest.raises(KVShapeError, match="D must be a multiple of 8; got D=12"):
        CodecKVCache(codec=RotatedKIVICodec(8, 3, 4, rotate_keys=False, rotate_values=False)).append(
            x[..., :12], x[..., :12]
        )
    for bad in (0, -4, 2.5, True):
        with pytest.raises(KVShapeError, match="dim must be a positive integer"):
            hadamard_rotation(bad)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"key_bits": 5}, r"key_bits must be one of \(2, 3, 4, 8\); got 5"),
        ({"value_bits": 1}, r"value_bits must be one of \(2, 3, 4, 8\); got 1"),
        ({"key_bits": True}, r"key_bits must be one of"),
        ({"rotate_keys": 1}, r"rotate_keys must be a bool; got 1"),
        ({"rotate_values": "yes"}, r"rotate_values must be a bool"),
        ({"exact_sink": None}, r"exact_sink must be a bool"),
        ({"seed": -1}, r"seed must be an integer >= 0"),
        ({"range_fit": "lloyd"}, r"range_fit must be one of \('minmax', 'gauss'\); got 'lloyd'"),
        ({"block_size": 0}, r"block_size must be an integer >= 1; got 0"),
        ({"window_bits": 4}, r"window_bits must be one of"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(KVConfigError, match=match):
        RotatedKIVICodec(**options)


def assert_triton_matches_torch(codecs: str, s: int = 61) -> None:
    """Under ``TRITON_INTERPRET=1`` (a subprocess): for each ``(codec, dtype)`` of the Python
    expression ``codecs`` (RotatedKIVICodec in scope), decode attention of the Triton kernel on a
    tiny cache of ``s`` tokens (D = 16, a masked prefix) equals the torch reference's."""
    pytest.importorskip("triton")
    script = textwrap.dedent(
        f"""
        import torch
        from flashcodec import CodecKVCache
        from flashcodec.attention import codec_decode_attention
        from flashcodec.codecs.rotated import RotatedKIVICodec
        g = torch.Generator().manual_seed(0)
        for codec, dtype in {codecs}:
            k = torch.randn(1, 2, {s}, 16, generator=g).to(dtype)
            v = torch.randn(1, 2, {s}, 16, generator=g).to(dtype)
            cache = CodecKVCache(codec=codec)
            cache.append(k, v)
            q = torch.randn(1, 4, 1, 16, generator=g).to(dtype)
            mask = torch.ones(1, {s}, dtype=torch.bool)
            mask[0, :5] = False
            want = codec_decode_attention(q, cache.keys, cache.values, key_mask=mask, backend="torch")
            got = codec_decode_attention(
                q, cache.keys, cache.values, key_mask=mask, backend="triton", blocks_per_split=1
            )
            err = (got.float() - want.float()).abs().max() / want.float().abs().max()
            assert err < (1e-5 if dtype == torch.float32 else 2e-2), (codec, float(err))
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.slow
def test_triton_kernel_matches_the_reference_under_the_interpreter():
    """The Triton kernel, unchanged, on rotated archives (query and tail rotated outside it)."""
    assert_triton_matches_torch(
        "((RotatedKIVICodec(16, raw_window=8), torch.float32),"
        " (RotatedKIVICodec(16, 2, 3, rotate_values=False), torch.bfloat16))"
    )


def test_transformers_decode_on_the_codes_equals_the_materialized_path():
    """apply_codec_attention on a tiny random Qwen3: the same tokens and logits as decoding then attending."""
    from conftest import assert_same_generation_on_the_codes

    assert_same_generation_on_the_codes(RotatedKIVICodec(16, 3, 2, raw_window=16))
