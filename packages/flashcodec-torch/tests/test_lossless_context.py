"""The context-model lossless coder (``flashcodec.codecs.lossless_context``) and the saved format's
``coder="context"``: bit for bit on every 16-bit pattern and on K/V-like data with zeros,
subnormals, infinities and NaNs; smaller than the exponent coder where channels are predictable;
damaged bytes and bad arguments refused with errors that say what is wrong."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch

pytest.importorskip("constriction")

from flashcodec.codecs.lossless import ExponentCoder  # noqa: E402
from flashcodec.codecs.lossless_context import MAGIC, ContextCoder  # noqa: E402
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """All 65,536 values of the 16-bit format (zeros, subnormals, inf, NaNs), shuffled, ``[4, 128, 128]``."""
    u = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    u = u[torch.randperm(u.numel(), generator=torch.Generator().manual_seed(0))]
    return u.view(dtype).view(4, 128, 128)


def kv_like(dtype: torch.dtype, shape=(2, 3, 256, 32), seed: int = 2) -> torch.Tensor:
    """Channels with their own scale and offset that drift slowly along the tokens (as RoPE'd keys
    do), with a few zeros, subnormals, infinities and NaNs mixed in."""
    g = torch.Generator().manual_seed(seed)
    lead, s, d = shape[:-2], shape[-2], shape[-1]
    scale = torch.exp(torch.randn(*lead, 1, d, generator=g))
    offset = torch.randn(*lead, 1, d, generator=g) * scale
    walk = torch.cumsum(torch.randn(*lead, s, d, generator=g) * 0.2, dim=-2)
    x = (offset + scale * (torch.sin(walk) + 0.1 * torch.randn(*lead, s, d, generator=g))).to(dtype)
    flat = x.view(-1)
    tiny = torch.finfo(dtype).tiny
    specials = [0.0, -0.0, tiny / 4, -tiny / 2, float("inf"), float("-inf"), float("nan")]
    for i, v in enumerate(specials):
        flat[(97 * (i + 1)) % flat.numel()] = v
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_every_bit_pattern_round_trips_exactly(dtype):
    x = every_pattern(dtype)
    out = ContextCoder.decode(ContextCoder().encode(x))
    assert out.dtype == dtype and torch.equal(bits(out), bits(x))


@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (2, 3, 70, 16), (1, 2, 1, 2, 129, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_shapes_and_special_values_round_trip(dtype, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -torch.finfo(dtype).tiny / 8])
    n = min(x.numel(), specials.numel())
    x.view(-1)[:n] = specials[:n].to(dtype)
    out = ContextCoder.decode(ContextCoder().encode(x))
    assert out.shape == x.shape and torch.equal(bits(out), bits(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_kv_like_data_round_trips_and_beats_the_exponent_coder(dtype):
    x = kv_like(dtype)
    assert torch.isnan(x).any() and torch.isinf(x).any()
    assert ((x != 0) & (x.abs() < torch.finfo(dtype).tiny)).any()  # subnormals
    blob = ContextCoder().encode(x)
    assert torch.equal(bits(ContextCoder.decode(blob)), bits(x))
    exponent = len(ExponentCoder(64).encode(x).to_bytes(6))
    assert len(blob) < exponent, (len(blob), exponent)


def test_tensors_of_one_length_are_coded_together():
    keys = kv_like(torch.bfloat16, (1, 2, 40, 16), seed=3)
    values = kv_like(torch.bfloat16, (3, 40, 8), seed=4)  # another leading shape and D
    out = ContextCoder.decode_many(ContextCoder().encode_many([keys, values]))
    assert [t.shape for t in out] == [keys.shape, values.shape]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(out, (keys, values), strict=True))
    with pytest.raises(KVDataError, match="decode_many"):
        ContextCoder.decode(ContextCoder().encode_many([keys, values]))


def test_model_parameters_travel_with_the_bytes():
    x = kv_like(torch.float16, (1, 1, 64, 8))
    coder = ContextCoder(codes=8, lane_weight=1, shared_weight=0, shared_mass=1)
    assert torch.equal(bits(ContextCoder.decode(coder.encode(x))), bits(x))


def test_bad_arguments_are_refused():
    for kwargs, match in (
        ({"codes": 3}, "codes must be an integer 4..64"),
        ({"codes": True}, "codes"),
        ({"lane_weight": 0}, "lane_weight"),
        ({"shared_mass": 1.5}, "shared_mass"),
    ):
        with pytest.raises(KVConfigError, match=match):
            ContextCoder(**kwargs)
    coder = ContextCoder()
    with pytest.raises(KVDtypeError, match="bfloat16 or float16"):
        coder.encode(torch.zeros(4, 4))
    with pytest.raises(KVDtypeError, match="torch.Tensor"):
        coder.encode_many([torch.zeros(4, 4, dtype=torch.bfloat16), "x"])
    with pytest.raises(KVShapeError, match=r"\[\.\.\., S, D\]"):
        coder.encode(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(KVShapeError, match="share dtype and length"):
        coder.encode_many([torch.zeros(4, 2, dtype=torch.bfloat16), torch.zeros(5, 2, dtype=torch.bfloat16)])
    with pytest.raises(KVShapeError, match="share dtype and length"):
        coder.encode_many([torch.zeros(4, 2, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.float16)])
    with pytest.raises(KVShapeError, match="at least one"):
        coder.encode_many([])


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(blob[5:9], "little")
    return json.loads(blob[9 : 9 + n]), blob[9 + n :]


def _join(header: dict, rest: bytes) -> bytes:
    text = json.dumps(header).encode()
    return MAGIC + len(text).to_bytes(4, "little") + text + rest


def test_damaged_bytes_are_refused():
    x = kv_like(torch.bfloat16, (1, 2, 64, 16))
    blob = ContextCoder().encode(x)
    header, rest = _split(blob)
    with pytest.raises(KVDataError, match="bad magic"):
        ContextCoder.decode(b"FCLL1" + blob[5:])
    with pytest.raises(KVDtypeError, match="bytes"):
        ContextCoder.decode("text")
    with pytest.raises(KVDataError, match="describes"):
        ContextCoder.decode(blob[:-3])
    # a flipped bit in each coded part: the range-coded streams, the packed mantissas, the maxima
    sizes = header["parts"]
    starts, at = {}, 0
    for name, size in sizes.items():
        starts[name] = at
        at += size
    for name in ("exponent_words", "sign_words", "mantissa", "top"):
        bad = bytearray(rest)
        bad[starts[name] + sizes[name] // 2] ^= 0x10
        with pytest.raises(KVDataError, match="damaged"):
            ContextCoder.decode(_join(header, bytes(bad)))
    for key, value, match in (
        ("dtype", "float32", "'dtype' must be one of"),
        ("shapes", [[2, 64, 16], [2, 65, 16]], "of one S"),
        ("shapes", [[1, 2, 64, 17]], "lane maxima"),
        ("model", [16, 4, 1], "'model' must be 4 integers"),
        ("model", [2, 4, 1, 256], "codes must be an integer"),
        ("crc32", "x", "'crc32'"),
        ("parts", {"top": 1}, "'parts' must give"),
    ):
        edited = dict(header, **{key: value})
        with pytest.raises((KVDataError, KVConfigError), match=match):
            ContextCoder.decode(_join(edited, rest))
    with pytest.raises(KVDataError, match="CRC-32"):
        ContextCoder.decode(_join(dict(header, crc32=header["crc32"] ^ 1), rest))
    with pytest.raises(KVDataError, match="header"):
        ContextCoder.decode(MAGIC + (5).to_bytes(4, "little") + b"{nope" + rest)


def test_a_missing_constriction_says_how_to_install_it(monkeypatch):
    x = torch.zeros(2, 2, dtype=torch.bfloat16)
    blob = ContextCoder().encode(x)
    monkeypatch.setitem(sys.modules, "constriction", None)
    with pytest.raises(ImportError, match=r"flashcodec-kv\[lossless\]"):
        ContextCoder().encode(x)
    with pytest.raises(ImportError, match="constriction"):
        ContextCoder.decode(blob)


# ---------------------------------------------------------------- the saved format's coder field
transformers = pytest.importorskip("transformers")

from flashcodec.hf.saved import cache_from_bytes, cache_to_bytes, load_cache, save_cache  # noqa: E402


def _cache(dtype=torch.bfloat16):
    """Three layers: two of 40 tokens, one (a sliding window) of 24, and an empty one."""
    cache = transformers.DynamicCache()
    for layer, s in enumerate((40, 24, 40)):
        k = kv_like(dtype, (1, 2, s, 16), seed=10 + layer)
        v = kv_like(dtype, (1, 2, s, 16), seed=20 + layer)
        cache.update(k, v, layer + 1)
    return cache


def _header(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[6:14], "little")
    return json.loads(data[14 : 14 + n]), data[14 + n : -32]


def _rebuilt(data: bytes, header: dict, magic: bytes | None = None) -> bytes:
    _, blobs = _header(data)
    text = json.dumps(header).encode()
    body = (magic or data[:6]) + len(text).to_bytes(8, "little") + text + blobs
    return body + hashlib.sha256(body).digest()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_saved_with_the_context_coder_round_trips(dtype, tmp_path):
    cache = _cache(dtype)
    path = tmp_path / "cache.fckv"
    written = save_cache(cache, path, coder="context")
    data = path.read_bytes()
    assert written == len(data) and data.startswith(b"FCKV3\n")
    header, _ = _header(data)
    assert header["coder"] == "context" and len(header["blocks"]) == 2  # one per length
    loaded = load_cache(path)
    assert loaded.layers[0].get_seq_length() == 0
    for a, b in zip(cache.layers[1:], loaded.layers[1:], strict=True):
        assert torch.equal(bits(a.keys), bits(b.keys)) and torch.equal(bits(a.values), bits(b.values))
    if dtype == torch.bfloat16:
        assert written < len(cache_to_bytes(cache))


def test_the_coder_is_recorded_and_checked():
    cache = _cache()
    exponent = cache_to_bytes(cache)
    assert exponent.startswith(b"FCKV2\n") and _header(exponent)[0]["coder"] == "exponent"
    # a file written before the coder was recorded (no field) still loads
    header, _ = _header(exponent)
    del header["coder"]
    old = cache_from_bytes(_rebuilt(exponent, header))
    assert torch.equal(bits(old.layers[2].keys), bits(cache.layers[2].keys))
    for name in ("context", "zstd"):
        with pytest.raises(KVDataError, match=f"names coder '{name}'.*allowed"):
            cache_from_bytes(_rebuilt(exponent, dict(header, coder=name)))
    context = cache_to_bytes(cache, coder="context")
    header, _ = _header(context)
    with pytest.raises(KVDataError, match="names coder 'exponent'"):
        cache_from_bytes(_rebuilt(context, dict(header, coder="exponent")))
    with pytest.raises(KVDataError, match="names coder None"):
        cache_from_bytes(_rebuilt(context, {"layers": header["layers"], "blocks": header["blocks"]}))
    with pytest.raises(KVDataError, match="another format"):
        cache_from_bytes(b"FCKV9\n" + bytes(60))


def test_a_context_header_that_does_not_describe_the_blocks_is_refused():
    context = cache_to_bytes(_cache(), coder="context")
    header, _ = _header(context)
    for blocks, match in (
        (header["blocks"][:1], "make 2 blocks"),
        ([header["blocks"][0], header["blocks"][1] + 1], "describes"),
        ("many", "'blocks' must list"),
    ):
        with pytest.raises(KVDataError, match=match):
            cache_from_bytes(_rebuilt(context, dict(header, blocks=blocks)))
    moved = json.loads(json.dumps(header))
    moved["layers"][1]["sizes"][0][2] = 1  # a 40-token tensor claimed by the 24-token block
    with pytest.raises(KVDataError, match="listed in block 1"):
        cache_from_bytes(_rebuilt(context, moved))
    reshaped = json.loads(json.dumps(header))
    reshaped["layers"][3]["sizes"][1][0] = [1, 2, 40, 8]  # same block, wrong D
    with pytest.raises(KVDataError, match="decodes to"):
        cache_from_bytes(_rebuilt(context, reshaped))


def test_bad_coder_arguments_are_refused():
    cache = _cache()
    with pytest.raises(KVConfigError, match=r"coder must be one of \['context', 'exponent'\]"):
        cache_to_bytes(cache, coder="zstd")
    with pytest.raises(KVConfigError, match="takes neither"):
        cache_to_bytes(cache, coder="context", group=32)
    with pytest.raises(KVConfigError, match="takes neither"):
        cache_to_bytes(cache, coder="context", level=1)
