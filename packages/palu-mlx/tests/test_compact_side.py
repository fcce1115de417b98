"""Compact side information: an 8-bit basis, one-byte per-token scales, an int8 recent window.

Each is opt-in (``palu_basis_bits``, ``palu_scale_bits``, ``palu_recent_bits`` at 8; 16 keeps what
every earlier tier measured), holds fewer bytes, codes close to the 16-bit form, and saves and
loads like the rest of a cache."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError
from palu_helpers import planted_lowrank, rel_err
from palu_mlx import KVCacheConfig, PaluKVCache
from palu_mlx.attention import PackedRows, _unpack, _unpacking, latent_attention
from palu_mlx.coders.fixed import GAUSSIAN_STEP, FixedQuantCoder, read_scales, store_scales
from palu_mlx.lowrank import PackedProjection, fit_group_projection, project, reconstruct
from palu_mlx.rope import Rotary
from palu_mlx.sinks import RecentWindow

D = 32
COMPACT = dict(palu_basis_bits=8, palu_scale_bits=8, palu_recent_bits=8)


def rotary() -> Rotary:
    return Rotary(mx.array(10000.0 ** (-np.arange(0, D, 2) / D), dtype=mx.float32), D, False)


def filled(tokens: int = 100, dtype=mx.bfloat16, rope: Rotary | None = None, **fields) -> PaluKVCache:
    fields = {"palu_bits": 2.0, **fields}
    config = KVCacheConfig(head_dim=D, palu_n_head_groups=4, palu_recent_tokens=8, **fields)
    cache = PaluKVCache(config, rotary=rope)
    keys = planted_lowrank((1, 4, tokens, D), rank=6, seed=1, noise=0.05).astype(dtype)
    values = planted_lowrank((1, 4, tokens, D), rank=5, seed=2, noise=0.05).astype(dtype)
    cache.update_and_fetch(keys[..., :40, :], values[..., :40, :])  # fits on the first 40
    for start in range(40, tokens, 7):  # then decode-sized appends
        cache.update_and_fetch(keys[..., start : start + 7, :], values[..., start : start + 7, :])
    return cache


def test_a_packed_basis_rebuilds_close_to_the_16_bit_one_in_about_half_the_bytes():
    x = planted_lowrank((1, 3, 200, 64), rank=12, seed=0, noise=0.05)
    proj = fit_group_projection(x, 3, 64).astype(mx.bfloat16)
    packed = PackedProjection.pack(proj)
    assert packed.codes.dtype == mx.int8 and packed.rank == 64 and packed.n_groups == 3
    full = sum(a.nbytes for a in proj.arrays().values())
    held = sum(a.nbytes for a in packed.arrays().values())
    assert held < 0.6 * full
    exact = reconstruct(project(x, proj), proj, mx.float32)
    assert rel_err(reconstruct(project(x, packed), packed, mx.float32), x) < rel_err(exact, x) + 2e-2
    # the unpacked basis is what the codes say: column-wise int8 times its scale
    basis = (
        np.array(packed.codes, dtype=np.float32) * np.array(packed.column_scales.astype(mx.float32))[:, None]
    )
    assert np.array_equal(np.array(packed.unpacked().basis), basis)


def test_packed_projection_refuses_bad_arrays():
    proj = fit_group_projection(planted_lowrank((1, 2, 50, 16), rank=4, seed=0), 2, 8)
    packed = PackedProjection.pack(proj)
    with pytest.raises(KVDtypeError, match="codes must be an int8"):
        PackedProjection(packed.codes.astype(mx.int32), packed.column_scales, packed.mean)
    with pytest.raises(KVShapeError, match="column_scales"):
        PackedProjection(packed.codes, packed.column_scales[:, :3], packed.mean)
    with pytest.raises(KVDtypeError, match="mean must be an mlx float"):
        PackedProjection(packed.codes, packed.column_scales, packed.mean.astype(mx.int32))


@pytest.mark.parametrize("scale", [2.0**-5, 0.0371, 1.0, 1.03, 3.3, 700.0])
def test_a_one_byte_scale_never_rounds_down_and_is_at_most_a_sixteenth_octave_up(scale):
    stored = store_scales(mx.array([[scale]], dtype=mx.float32), 8)
    assert stored.shape == (1, 1) and stored.dtype == mx.uint8
    back = read_scales(stored, 8).item()
    assert scale * (1 - 1e-4) <= back <= scale * 2 ** (1 / 16) * (1 + 1e-6)
    # the 16-bit form is the bfloat16 the coder always stored
    two = store_scales(mx.array([[scale]]), 16)
    assert two.shape == (1, 2) and read_scales(two, 16).item() == mx.array(scale).astype(mx.bfloat16).item()


def test_one_byte_scales_cost_a_byte_per_row_and_little_error():
    rng = np.random.default_rng(0)
    widths = (4, 3, 3, 2, 2, 2, 1, 1)
    steps = mx.array(rng.uniform(0.2, 1.0, size=(2, len(widths))).astype(np.float32))
    latents = mx.array(rng.normal(size=(1, 2, 300, len(widths))).astype(np.float32))
    err = {}
    for bits in (16, 8):
        coder = FixedQuantCoder(widths, steps, True, bits)
        rows = coder.encode(latents)
        assert rows.shape[-1] == coder.bytes_per_row == coder.code_bytes + (2 if bits == 16 else 1)
        err[bits] = rel_err(coder.decode(rows), latents)
        # attention unpacks the same codes and scales the coder wrote
        codes, scale = _unpack(rows, _unpacking(PackedRows(rows, widths, steps, True, bits)))
        offset = 0.5 - (1 << np.array(widths)) / 2.0
        rebuilt = (np.array(codes) + offset) * np.array(steps)[None, :, None, :] * np.array(scale)
        np.testing.assert_allclose(rebuilt, np.array(coder.decode(rows)), rtol=1e-6, atol=1e-6)
    assert err[8] < 1.1 * err[16]
    with pytest.raises(KVConfigError, match="scale_bits=4"):
        FixedQuantCoder(widths, steps, True, 4)


def test_an_int8_window_holds_its_rows_in_about_half_the_bytes():
    keys = mx.random.normal((1, 2, 50, D), key=mx.random.key(0)).astype(mx.bfloat16)
    values = mx.random.normal((1, 2, 50, D), key=mx.random.key(1)).astype(mx.bfloat16)
    exact, small = RecentWindow(16), RecentWindow(16, bits=8)
    for prev, stop in ((0, 30), (30, 31), (31, 50)):
        exact = exact.write(keys[..., prev:stop, :], values[..., prev:stop, :], prev)
        small = small.write(keys[..., prev:stop, :], values[..., prev:stop, :], prev)
    assert small.start == exact.start == 34
    for got, want in zip(small.rows(34, 50), exact.rows(34, 50), strict=True):
        assert got.dtype == want.dtype and rel_err(got.astype(mx.float32), want.astype(mx.float32)) < 1e-2
    assert sum(a.nbytes for a in small.arrays()) < 0.6 * sum(a.nbytes for a in exact.arrays())
    assert [a.dtype for a in small.tensor_arrays("key")] == [mx.int8, mx.bfloat16]
    cut = small.cut(40)
    assert cut.start == 34 and cut.keys.shape[2] == 6 and cut.key_scales.shape[2] == 6


def test_the_compact_cache_holds_fewer_bytes_and_attends_like_its_rebuild():
    wide, compact = filled(), filled(**COMPACT)
    assert compact.nbytes < wide.nbytes
    assert compact._key_proj.arrays()["basis"].dtype == mx.int8
    assert compact._key_coder.bytes_per_row == wide._key_coder.bytes_per_row - 1
    for a, b in zip(wide._fetch(), compact._fetch(), strict=True):
        assert rel_err(b.astype(mx.float32), a.astype(mx.float32)) < 0.05
    q = mx.random.normal((1, 8, 3, D), key=mx.random.key(3))
    keys, values = compact._fetch()
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.2, mask="causal")
    for packed in (True, False):
        got = latent_attention(q, compact.latent_store(), 0.2, "causal", packed=packed)
        assert rel_err(got, want) < 2e-2  # bf16 rebuild against float32 attention


@pytest.mark.parametrize("rope", [None, rotary()], ids=["no-rope", "pre-rope"])
@pytest.mark.parametrize("fields", [COMPACT, dict(palu_basis_bits=8), dict(palu_recent_bits=8)], ids=str)
def test_a_compact_state_loads_back_bitwise(rope, fields):
    cache = filled(rope=rope, **fields)
    restored = PaluKVCache.from_state(cache.state)
    for a, b in zip(cache._fetch(), restored._fetch(), strict=True):
        assert mx.array_equal(a, b).item()
    assert restored.nbytes == cache.nbytes
    # and keeps coding the same way after loading
    more = planted_lowrank((1, 4, 3, D), rank=6, seed=9).astype(mx.bfloat16)
    for a, b in zip(cache.update_and_fetch(more, more), restored.update_and_fetch(more, more), strict=True):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("key.basis_scale", "drop", "missing array 'key.basis_scale'"),
        ("value.basis", "float", "dtype"),
        ("recent.key_scales", "drop", "missing array 'recent.key_scales'"),
        ("recent.values", "short", "shape"),
    ],
)
def test_a_compact_state_missing_or_misshaping_a_part_is_refused(name, change, message):
    state = dict(filled(**COMPACT).state)
    meta = json.loads(bytes(np.array(state.pop("meta_state"))).decode())["meta_state"]
    if change == "drop":
        del state[name]
    elif change == "float":
        state[name] = state[name].astype(mx.float16)
    else:
        state[name] = state[name][..., :1, :]
    with pytest.raises(KVDataError, match=message):
        PaluKVCache.from_state(state, meta)


@pytest.mark.parametrize("field", sorted(COMPACT))
def test_a_state_whose_coded_with_lacks_a_compact_field_is_refused(field):
    cache = filled()
    settings, runtime = cache.meta_state
    meta = json.loads(runtime)
    del meta["coded_with"][field]
    state = {k: v for k, v in cache.state.items() if k != "meta_state"}
    with pytest.raises(
        KVDataError, match=rf"coded_with=.*must be an object of the fields .*\(it lacks \['{field}'\]\)"
    ):
        PaluKVCache.from_state(state, (settings, json.dumps(meta)))


@pytest.mark.parametrize("field", sorted(COMPACT))
@pytest.mark.parametrize("value", [4, 16.0, True, "8"])
def test_the_compact_fields_take_16_or_8(field, value):
    with pytest.raises(KVConfigError, match=field):
        KVCacheConfig(**{field: value})
    assert getattr(KVCacheConfig(**{field: 8}), field) == 8


def test_filled_rows_spend_their_padding_bits_and_keep_their_bytes():
    rng = np.random.default_rng(1)
    widths = (5, 3, 3, 2, 2, 1, 1)  # 17 bits: 3 bytes, 7 bits of padding
    sigma = np.sort(rng.uniform(0.2, 2.0, size=(2, len(widths))), axis=1)[:, ::-1]
    steps = mx.array((sigma * np.array([GAUSSIAN_STEP[w] for w in widths])).astype(np.float32))
    coder = FixedQuantCoder(widths, steps, True, 8)
    filled = coder.filled()
    assert filled.bits_per_row == 24 and filled.bytes_per_row == coder.bytes_per_row
    assert all(a >= b for a, b in zip(filled.widths, widths, strict=True))
    # the steps still say each channel's spread
    again = np.array(filled.steps) / np.array([GAUSSIAN_STEP[w] for w in filled.widths])
    np.testing.assert_allclose(again, sigma, rtol=1e-5)
    latents = mx.array(
        (rng.normal(size=(1, 2, 400, len(widths))) * sigma[None, :, None, :]).astype(np.float32)
    )
    assert rel_err(filled.decode(filled.encode(latents)), latents) < rel_err(
        coder.decode(coder.encode(latents)), latents
    )
    assert filled.filled() == filled  # nothing left to spend


def test_a_filled_cache_holds_the_same_bytes_with_less_error():
    plain, full = filled(palu_bits=1.7), filled(palu_bits=1.7, palu_fill_rows=True)
    assert full.nbytes == plain.nbytes
    assert full._key_coder.bits_per_row % 8 == 0 and full._value_coder.bits_per_row % 8 == 0
    assert full._key_coder.bits_per_row + full._value_coder.bits_per_row > (
        plain._key_coder.bits_per_row + plain._value_coder.bits_per_row
    )
    restored = PaluKVCache.from_state(full.state)
    for a, b in zip(full._fetch(), restored._fetch(), strict=True):
        assert mx.array_equal(a, b).item()
    with pytest.raises(KVConfigError, match="palu_fill_rows"):
        KVCacheConfig(palu_fill_rows=1)
    with pytest.raises(KVConfigError, match="palu_fill_rows=True with palu_calibration"):
        KVCacheConfig(palu_fill_rows=True, palu_calibration="m.safetensors")


def test_filled_rows_are_refused_under_tensor_parallel():
    from palu_mlx.distributed import HeadShard
    from palu_mlx.projection_source import FitAtPrefill

    config = KVCacheConfig(head_dim=D, palu_fill_rows=True)
    with pytest.raises(KVConfigError, match="palu_fill_rows=True under tensor parallel"):
        FitAtPrefill(config, shard=HeadShard(None, 2, 4))
