"""flashcodec.integrations.kv_pages: paged-engine pages <-> [H, S, D] K/V <-> coded bytes (no engine needed)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_walk
from flashcodec.integrations.kv_pages import PagedKVCoder, gather_pages, scatter_pages
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError

NB, H, BS, D = 5, 2, 128, 64


def pages(dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    # smooth along the tokens, as real K/V are: both halves of each page from a random walk
    x = random_walk(b=NB, h=H, s=2 * BS, d=D, seed=seed, dtype=torch.float32)  # [NB, H, 2*BS, D]
    return x.reshape(NB, H, BS, 2 * D).to(dtype)


def test_gather_follows_the_cpu_backends_view():
    layer = pages()
    # the CPU backend's own split: view [NB, H, 2 * BS, D], keys the first BS rows, values the rest
    key_cache, value_cache = layer.view(NB, H, 2 * BS, D).chunk(2, dim=2)
    k, v = gather_pages(layer, [3, 0])
    assert k.shape == v.shape == (H, 2 * BS, D)
    assert torch.equal(k[:, :BS], key_cache[3]) and torch.equal(k[:, BS:], key_cache[0])
    assert torch.equal(v[:, :BS], value_cache[3]) and torch.equal(v[:, BS:], value_cache[0])


def test_scatter_inverts_gather_and_touches_only_its_pages():
    layer = pages()
    k, v = gather_pages(layer, [4, 1])
    out = torch.zeros_like(layer)
    scatter_pages(out, [4, 1], k, v)
    assert torch.equal(out[4], layer[4]) and torch.equal(out[1], layer[1])
    assert not out[[0, 2, 3]].any()
    k0, v0 = gather_pages(layer, [])  # no pages: empty sequences, and writing them changes nothing
    assert k0.shape == v0.shape == (H, 0, D)
    scatter_pages(out, [], k0, v0)
    assert not out[[0, 2, 3]].any()


@pytest.mark.parametrize(
    "fmt,dtype",
    [
        ("raw", torch.float32),
        ("raw", torch.bfloat16),
        ("exponent", torch.bfloat16),
        ("exponent", torch.float16),
    ],
)
def test_lossless_formats_are_bit_exact(fmt, dtype):
    k, v = gather_pages(pages(dtype), [2, 0, 1])
    coder = PagedKVCoder(fmt)
    blob, payload = coder.encode(k, v)
    k2, v2 = coder.decode(blob)
    assert coder.lossless
    assert k2.dtype == dtype and torch.equal(k2, k) and torch.equal(v2, v)
    assert payload <= len(blob)
    if fmt == "exponent":  # smooth 16-bit K/V: the exponents code in fewer than 8 bits each
        assert payload < k.nbytes + v.nbytes


@pytest.mark.parametrize("fmt,bound", [("kivi64r-k4v4-w64i8-s8", 0.1), ("kivi64r-k3v3-w64i8-s8z4", 0.25)])
def test_tier_formats_shrink_and_stay_close(fmt, bound):
    k, v = gather_pages(pages(torch.bfloat16), [0, 1, 2, 3])
    coder = PagedKVCoder(fmt)
    blob, payload = coder.encode(k, v)
    k2, v2 = coder.decode(blob)
    assert not coder.lossless
    assert payload < 0.4 * (k.nbytes + v.nbytes)  # 4 or 3 code bits an element plus scales, vs 16
    for a, b in ((k, k2), (v, v2)):
        err = (a.float() - b.float()).norm() / a.float().norm()
        assert 0 < err < bound, err  # lossy, by about a code step


def test_decode_refuses_another_format_or_damage():
    k, v = gather_pages(pages(), [0])
    blob, _ = PagedKVCoder("raw").encode(k, v)
    with pytest.raises(KVDataError, match="coded as 'raw'"):
        PagedKVCoder("kivi64r-k4v4-w64i8-s8").decode(blob)
    with pytest.raises(KVDataError):
        PagedKVCoder("raw").decode(blob[: len(blob) // 2])


def test_bad_arguments_raise_and_leave_pages_unchanged():
    layer = pages()
    before = layer.clone()
    k, v = gather_pages(layer, [0, 1])
    with pytest.raises(KVConfigError, match="format"):
        PagedKVCoder("zip")
    with pytest.raises(KVShapeError, match="block_ids"):
        gather_pages(layer, [0, NB])
    with pytest.raises(KVShapeError, match="block_ids"):
        scatter_pages(layer, [0.5], k[:, :BS], v[:, :BS])
    with pytest.raises(KVShapeError, match="shape"):
        scatter_pages(layer, [0], k, v)  # two pages' worth for one page
    with pytest.raises(KVShapeError, match="kv_layer"):
        gather_pages(layer.view(NB, H, -1), [0])
    with pytest.raises(KVDtypeError, match="bfloat16 or float16"):
        PagedKVCoder("exponent").encode(k.float(), v.float())
    with pytest.raises(KVShapeError, match="agree"):
        PagedKVCoder("raw").encode(k, v[:, :BS])
    assert torch.equal(layer, before)
