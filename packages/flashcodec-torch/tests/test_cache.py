"""CodecKVCache: API, archive growth, storage accounting, validation, state round trip."""

from __future__ import annotations

import kvspec
import pytest
import torch
from conftest import CODECS, gaussian, random_walk
from flashcodec import CodecKVCache
from flashcodec.codecs import ChannelInt4Codec
from flashcodec.stream import SPARE_BLOCKS, spare_blocks


def test_meets_the_kvspec_protocol():
    assert isinstance(CodecKVCache(), kvspec.KVCacheLayer)


@pytest.mark.parametrize("tier", CODECS)
def test_forward_then_decode_shapes_and_dtypes(tier):
    cache = CodecKVCache(codec=CODECS[tier])
    k, v = random_walk(s=21, dtype=torch.bfloat16), random_walk(s=21, d=8, seed=1, dtype=torch.bfloat16)
    out_k, out_v = cache.forward(k, v)
    assert out_k.shape == (2, 3, 21, 16) and out_v.shape == (2, 3, 21, 8)
    assert out_k.dtype == out_v.dtype == torch.bfloat16
    for t in range(5):
        out_k, out_v = cache.decode_step(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert out_k.shape == (2, 3, 26, 16) and cache.offset == 26
    w = cache.codec.raw_window  # a raw window keeps the newest w tokens uncoded
    assert cache.keys.n_blocks == max(0, 26 - w) // cache.codec.block_size and cache.keys.seq_len == 26


def test_tail_holds_fewer_than_r_raw_tokens():
    cache = CodecKVCache("jpeg", block_size=8, keep_freqs=2)
    x = random_walk(s=13)
    k, _ = cache.forward(x, x)
    assert cache.keys.n_blocks == 1 and cache.keys.tail_len == 5
    assert torch.equal(k[:, :, 8:], x[:, :, 8:])  # the tail is returned raw
    assert not torch.equal(k[:, :, :8], x[:, :, :8])  # the archived block is reconstructed (k=2)


def test_archive_grows_in_place_with_a_bounded_reserve():
    cache = CodecKVCache("jpeg", block_size=2, keep_freqs=1)
    x = gaussian(b=1, h=1, s=2 * 70, d=4)
    capacities, reallocations, last = [], 0, (0, None)
    for t in range(x.shape[2]):
        cache.decode_step(x[:, :, t : t + 1], x[:, :, t : t + 1])
        cap = cache.keys.capacity
        ptr = cache.keys.archive[0].data_ptr() if cache.keys.archive else None
        if cap == last[0]:
            assert ptr == last[1]  # same buffer between doublings: blocks are written in place
        else:
            reallocations += 1
        capacities.append(cap)
        last = (cap, ptr)
    # each growth reserves at most SPARE_BLOCKS (4) more than needed: 5, 10, 15, 16, 21, ...
    assert capacities[:12] == [0, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 10]
    assert all(0 <= cap - (t + 1) // 2 <= SPARE_BLOCKS for t, cap in enumerate(capacities) if cap)
    assert reallocations == len(set(capacities)) - 1 == 15  # one allocation per regrowth, none per block
    assert cache.keys.n_blocks == 70


def test_long_blocks_reserve_no_more_than_32_tokens():
    # chan64: one spare 64-token block would be 3% of a 2,048-token archive, so none is reserved
    assert spare_blocks(8) == SPARE_BLOCKS == 4 and spare_blocks(16) == 2 and spare_blocks(64) == 0
    cache = CodecKVCache(codec=ChannelInt4Codec(64))
    x = gaussian(b=1, h=1, s=64 * 3 + 5, d=4)
    cache.forward(x[:, :, :100], x[:, :, :100])
    assert cache.keys.capacity == cache.keys.n_blocks == 1
    for t in range(100, x.shape[2]):
        cache.decode_step(x[:, :, t : t + 1], x[:, :, t : t + 1])
        assert cache.keys.capacity == cache.keys.n_blocks


def test_full_fill_allocates_once():
    cache = CodecKVCache("jpeg", block_size=8, keep_freqs=2)
    x = gaussian(b=1, h=1, s=8 * 100, d=4)
    cache.forward(x, x)
    assert cache.keys.capacity == 100 + SPARE_BLOCKS  # doubling would reserve 128


@pytest.mark.parametrize("tier", CODECS)
def test_storage_is_measured_and_split(tier):
    cache = CodecKVCache(codec=CODECS[tier])
    b, h, s, d = 2, 3, 8 * 20 + 3, 16
    x = random_walk(b, h, s, d)
    cache.forward(x, x)
    st = cache.storage_bytes()
    assert st.raw == 2 * b * h * s * d * 4 == cache.raw_nbytes
    r = cache.codec.block_size
    blocks = max(0, s - cache.codec.raw_window) // r  # a raw window keeps its tokens uncoded
    per_token = d * 4 if cache.codec.window_bits is None else d + 2 * 4  # int8 codes + fp32 scale, zero
    assert st.tail == 2 * b * h * (s - r * blocks) * per_token
    assert st.held == st.used + st.tail == cache.nbytes == sum(t.nbytes for t in cache.state)
    assert st.allocated >= st.used + st.tail
    k, _ = cache.read()
    assert st.view >= 2 * k.nbytes  # forward returned the view, so it is held and counted apart
    per_block = {
        "png-keep1": d * 4 + 7 * d * 8,  # fp32 anchor + fp64 deltas
        "png-keep0.5": d * 4 + 7 * d * 8,  # pruning does not shrink the dense layout
        "jpeg-k8": 8 * d * 4,
        "jpeg-k8-int8": 8 * d + 8 * 4,  # int8 coefficients + fp32 scales
        "jpeg-k8-int4": 8 * d // 2 + 8 * 4,  # two int4 codes a byte + fp32 scales
        "jpeg-k8-int4z": 8 * d // 2 + 8 * (2 + 2),  # two int4 codes a byte + fp16 scales and zeros
        "jpeg-mixed-84": 2 * d + 5 * d // 2 + 7 * 4,  # 2 int8 rows, 5 int4 rows, 7 fp32 scales
        "jpeg-k4": 4 * d * 4,
        "jpeg-k2": 2 * d * 4,
        "jpeg-k2-int8": 2 * d + 2 * 4,
        "chan64-int4": 64 * d // 2 + d * (2 + 2),  # two int4 codes a byte + fp16 scale and zero per channel
        # keys: fp16 scale and zero per channel; values: per token (mean of the two streams)
        "kivi64-k4v4": (64 * d // 2 + d * 4 + 64 * d // 2 + 64 * 4) // 2,
        "kivi64-k8v8": (64 * d + d * 4 + 64 * d + 64 * 4) // 2,
        # rotated: the same layout; 3-bit codes take 3 bytes per 8, 2-bit ones a byte per 4
        "kivi64r-k4v4": (64 * d // 2 + d * 4 + 64 * d // 2 + 64 * 4) // 2,
        "kivi64r-k3v3": (64 * d * 3 // 8 + d * 4 + 64 * d * 3 // 8 + 64 * 4) // 2,
        "kivi64r-k3v2": (64 * d * 3 // 8 + d * 4 + 64 * d // 4 + 64 * 4) // 2,
        # 8-bit side information: a uint8 scale and a zero point (int8, or fp16 for the keys under
        # the exact sink) per channel or token, one fp16 base per block and stream
        "kivi64r-k4v4-w64i8-s8": (64 * d // 2 + d * 3 + 2 + 64 * d // 2 + 64 * 2 + 2) // 2,
        "kivi64r-k3v3-w64i8-s8z4": (64 * d * 3 // 8 + d * 3 + 2 + 64 * d * 3 // 8 + 64 + 32 + 2) // 2,
        "kivi64r-k3v2-w64i8-s8z4": (64 * d * 3 // 8 + d * 3 + 2 + 64 * d // 4 + 64 + 32 + 2) // 2,
        "kivi64r-k8v8-w32-s8": (64 * d + d * 3 + 2 + 64 * d + 64 * 2 + 2) // 2,
        "kivi64r-k3v3-w0i8-s8": (64 * d * 3 // 8 + d * 3 + 2 + 64 * d * 3 // 8 + 64 * 2 + 2) // 2,
        "kivi64r-k3v2-w0i8-s8z4": (64 * d * 3 // 8 + d * 3 + 2 + 64 * d // 4 + 64 + 32 + 2) // 2,
        "kivi64r-k3v2-w0i8-s8z4-vs1": (64 * d * 3 // 8 + d * 3 + 2 + 64 * d // 4 + 64 + 32 + 2) // 2,
    }[tier.removesuffix("-w64").removesuffix("-w96i8").removesuffix("-w64i8")]
    # a value sink: its tokens in the int8 window's form, once a block is archived
    sink = b * h * cache.codec.value_codec.sink_tokens * (d + 2 * 4) if blocks else 0
    assert st.used == 2 * b * h * blocks * per_block + sink


def test_view_is_released_and_rebuilt():
    cache = CodecKVCache("jpeg", keep_freqs=4)
    x = random_walk(s=40)
    k1, _ = cache.forward(x, x)
    k1 = k1.clone()
    cache.release_view()
    assert cache.storage_bytes().view == 0 and not cache.keys.has_view
    k2, _ = cache.read()
    assert torch.equal(k1, k2)


def test_state_round_trip_continues_identically():
    for tier, cfg in CODECS.items():
        a = CodecKVCache(codec=cfg)
        x = random_walk(s=29, dtype=torch.float16)
        a.forward(x, -x)
        b = CodecKVCache.from_state(a.state, a.meta_state)
        assert all(isinstance(m, str) for m in a.meta_state)
        assert b.offset == a.offset and b.nbytes == a.nbytes, tier
        y = random_walk(s=11, seed=3, dtype=torch.float16)
        ka, va = a.update_and_fetch(y, -y)
        kb, vb = b.update_and_fetch(y, -y)
        assert torch.equal(ka, kb) and torch.equal(va, vb), tier


def test_empty_state_round_trip():
    a = CodecKVCache("png")
    assert a.state == () and a.empty() and a.nbytes == 0
    b = CodecKVCache.from_state(a.state, a.meta_state)
    assert b.empty() and b.codec == a.codec


def test_from_state_rejects_bad_meta_and_arrays():
    a = CodecKVCache("jpeg", keep_freqs=2)
    x = random_walk(s=20)
    a.forward(x, x)
    with pytest.raises(kvspec.KVConfigError, match="meta_state"):
        CodecKVCache.from_state(a.state, ("mode=jpeg",))
    with pytest.raises(kvspec.KVDataError, match="state must hold"):
        CodecKVCache.from_state(a.state[:2], a.meta_state)
    bad = list(a.state)
    bad[0] = bad[0][:, :, :, :1]  # wrong K
    with pytest.raises(kvspec.KVDataError, match="coeffs"):
        CodecKVCache.from_state(bad, a.meta_state)


def test_reset_frees_the_shape():
    cache = CodecKVCache()
    cache.forward(gaussian(d=16), gaussian(d=16))
    cache.reset()
    assert cache.empty()
    k, _ = cache.update_and_fetch(gaussian(b=1, d=4), gaussian(b=1, d=4))
    assert k.shape == (1, 3, 64, 4)


def test_forward_starts_over():
    cache = CodecKVCache("png")
    x = gaussian(s=20)
    cache.forward(x, x)
    k, _ = cache.forward(x[:, :, :5], x[:, :, :5])
    assert cache.offset == 5 and torch.equal(k, x[:, :, :5])


# ---------------------------------------------------------------- bad configuration
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="gif"), "mode"),
        (dict(block_size=0), "block_size"),
        (dict(keep_freqs=0), "keep_freqs"),
        (dict(keep_freqs=9), "keep_freqs"),
        (dict(mode="png", keep_ratio=0.0), "keep_ratio"),
        (dict(mode="png", keep_ratio=1.01), "keep_ratio"),
        (dict(quant_bits=3), "quant_bits"),
        (dict(mode="png", quant_bits=8), "quant_bits"),
        (dict(mode="png", keep_freqs=2), "keep_freqs"),
        (dict(mode="jpeg", keep_ratio=0.5), "keep_ratio"),
        (dict(check_finite="yes"), "check_finite"),
        (dict(initial_blocks=0), "initial_blocks"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(kvspec.KVConfigError, match=match):
        CodecKVCache(**kwargs)


# ---------------------------------------------------------------- bad input leaves the cache as it was
def _snapshot(cache):
    return cache.offset, cache.nbytes, [t.clone() for t in cache.state]


def _same(cache, snap):
    offset, nbytes, state = snap
    return (
        cache.offset == offset
        and cache.nbytes == nbytes
        and len(state) == len(cache.state)
        and all(torch.equal(a, b) for a, b in zip(state, cache.state, strict=True))
    )


def _bad_inputs():
    good = random_walk(s=3)
    nan = good.clone()
    nan[0, 0, 1, 2] = float("nan")
    inf = good.clone()
    inf[1, 2, 0, 0] = float("inf")
    return {
        "rank": (kvspec.KVShapeError, good[0], good[0]),
        "kv-mismatch": (kvspec.KVShapeError, good, good[:, :, :2]),
        "batch-changed": (kvspec.KVShapeError, good[:1], good[:1]),
        "heads-changed": (kvspec.KVShapeError, good[:, :2], good[:, :2]),
        "dim-changed": (kvspec.KVShapeError, good[..., :8], good),
        "zero-length": (kvspec.KVShapeError, good[:, :, :0], good[:, :, :0]),
        "kv-dtype": (kvspec.KVDtypeError, good, good.half()),
        "dtype-changed": (kvspec.KVDtypeError, good.half(), good.half()),
        "int-dtype": (kvspec.KVDtypeError, good.long(), good.long()),
        "float64": (kvspec.KVDtypeError, good.double(), good.double()),
        "not-a-tensor": (kvspec.KVDtypeError, good.numpy(), good),
        "nan": (kvspec.KVValueError, nan, good),
        "inf": (kvspec.KVValueError, good, inf),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
@pytest.mark.parametrize("tier", ["jpeg-k2-int8", "png-keep1"])
def test_bad_input_raises_and_leaves_cache_unchanged(tier, case):
    cache, twin = CodecKVCache(codec=CODECS[tier]), CodecKVCache(codec=CODECS[tier])
    x = random_walk(s=13)
    cache.forward(x, x)
    twin.forward(x, x)
    snap = _snapshot(cache)
    err, k, v = _bad_inputs()[case]
    with pytest.raises(err):
        cache.update_and_fetch(k, v)
    assert _same(cache, snap)
    y = random_walk(s=5, seed=9)
    ka, va = cache.update_and_fetch(y, y)
    kb, vb = twin.update_and_fetch(y, y)
    assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_error_messages_name_the_value():
    cache = CodecKVCache()
    cache.forward(gaussian(), gaussian())
    with pytest.raises(kvspec.KVDtypeError, match="float16"):
        cache.update_and_fetch(gaussian().half(), gaussian().half())
    with pytest.raises(kvspec.KVConfigError, match="got 9"):
        CodecKVCache(keep_freqs=9)


def test_check_finite_can_be_disabled():
    cache = CodecKVCache("png", check_finite=False)
    x = gaussian(s=3)
    x[0, 0, 0, 0] = float("nan")
    k, _ = cache.update_and_fetch(x, x)
    assert torch.isnan(k[0, 0, 0, 0])


@pytest.mark.parametrize("n", [-1, 1.5, True])
def test_bad_trim_raises_and_leaves_cache(n):
    cache = CodecKVCache()
    x = random_walk(s=13)
    cache.forward(x, x)
    snap = _snapshot(cache)
    with pytest.raises(kvspec.KVTrimError):
        cache.trim(n)
    assert _same(cache, snap)


def test_trim_clamps_and_reports():
    cache = CodecKVCache()
    x = random_walk(s=13)
    cache.forward(x, x)
    assert cache.is_trimmable()
    assert cache.trim(3) == 3 and cache.offset == 10
    assert cache.trim(100) == 10 and cache.empty()


@pytest.mark.parametrize("idx", [[0, 2], [[0, 1]], [0.0, 1.0], []])
def test_bad_beam_index_raises_and_leaves_cache(idx):
    cache = CodecKVCache()
    x = random_walk(s=13)
    cache.forward(x, x)
    snap = _snapshot(cache)
    with pytest.raises(kvspec.KVShapeError, match="beam_idx"):
        cache.reorder(torch.tensor(idx))
    assert _same(cache, snap)


def test_device_mixing_raises_and_leaves_cache():
    # the "meta" device stands in for a second device on a CPU-only machine
    cache = CodecKVCache()
    x = random_walk(s=13)
    cache.forward(x, x)
    snap = _snapshot(cache)
    on_meta = torch.empty(2, 3, 1, 16, device="meta")
    with pytest.raises(kvspec.KVDtypeError, match="one device"):
        cache.update_and_fetch(x[:, :, :1], on_meta)
    with pytest.raises(kvspec.KVDtypeError, match="device is fixed"):
        cache.update_and_fetch(on_meta, on_meta)
    assert _same(cache, snap)
