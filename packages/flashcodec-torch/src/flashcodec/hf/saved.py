"""Save a transformers K/V cache losslessly in fewer bytes, and load it back.

    from flashcodec.hf.saved import save_cache, load_cache
    nbytes = save_cache(cache, "prompt.fckv")          # a DynamicCache after a prefill
    cache = load_cache("prompt.fckv", config=model.config)
    model.generate(ids, cache=cache, ...)             # the same tokens as with the original cache

Every layer's keys and values go through :class:`flashcodec.codecs.lossless.ExponentCoder`
(exponent codes against a per-(group, channel) maximum, zlib-compressed; sign and mantissa bits
as they are), so the loaded tensors equal the saved ones bit for bit. The file is smaller than the
cache's raw bytes for bf16 K/V (see ``docs/flashcodec.md`` for the ratio measured on the real
model); fp16 K/V shrink less, having three more mantissa bits, which are close to random.

Layers saved: every layer with ``keys`` / ``values`` tensors (``DynamicLayer``, sliding-window
layers); a layer holding anything else (linear-attention state) is refused with ``KVConfigError``.

The file: a magic line, the header's length and the header (JSON: per layer, each tensor's shape,
dtype and byte count), the coded tensors, and a SHA-256 of everything before it. Loading checks the
digest first, then that the header describes exactly the bytes that follow, so a flipped byte, a
cut file or an edited header is a ``KVDataError``, never a different cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from kvspec import KVConfigError, KVDataError, KVDtypeError

from ..codecs.lossless import FORMATS, ExponentCoder, ExponentPacked

__all__ = ["save_cache", "load_cache", "cache_to_bytes", "cache_from_bytes"]

_MAGIC = b"FCKV2\n"
#: bytes of the SHA-256 that ends the file
_DIGEST = 32


def cache_to_bytes(cache: Any, *, group: int = 64, level: int = 6) -> bytes:
    """The bytes :func:`save_cache` writes: ``cache``'s layers (transformers ``Cache`` with
    ``layers`` whose ``keys`` / ``values`` are bf16 or fp16 ``[B, H, S, D]``), each coded losslessly."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, (list, tuple)):
        raise KVConfigError(f"cache must be a transformers Cache with .layers; got {type(cache).__name__}")
    coder = ExponentCoder(group)
    blobs: list[bytes] = []
    meta: list[dict[str, Any]] = []
    for i, layer in enumerate(layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not getattr(layer, "is_initialized", True) or (keys is None and values is None):
            meta.append({"empty": True})
            continue
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise KVConfigError(
                f"layer {i} ({type(layer).__name__}) holds no keys/values tensors; only attention layers can be saved"
            )
        entry: dict[str, Any] = {"empty": False, "sizes": []}
        for t in (keys, values):
            if t.dtype not in FORMATS:
                raise KVDtypeError(
                    f"layer {i}: K/V must be bfloat16 or float16 to save losslessly; got {t.dtype}"
                )
            if t.numel() == 0:
                entry["sizes"].append([list(t.shape), str(t.dtype).removeprefix("torch."), 0])
                continue
            blob = coder.encode(t.detach().cpu()).to_bytes(level)
            entry["sizes"].append([list(t.shape), str(t.dtype).removeprefix("torch."), len(blob)])
            blobs.append(blob)
        meta.append(entry)
    header = json.dumps({"layers": meta}).encode()
    body = b"".join([_MAGIC, len(header).to_bytes(8, "little"), header, *blobs])
    return body + hashlib.sha256(body).digest()


def cache_from_bytes(data: bytes, *, config: Any = None, device: torch.device | str = "cpu") -> Any:
    """A transformers ``DynamicCache`` (laid out from ``config`` when given) holding exactly the
    keys and values in ``data`` (from :func:`cache_to_bytes`), on ``device``."""
    from transformers import DynamicCache

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise KVDtypeError(f"data must be bytes; got {type(data).__name__}")
    data = bytes(data)
    if data.startswith(b"FCKV") and not data.startswith(_MAGIC):
        raise KVDataError(
            f"data is a saved flashcodec cache of another format ({data[:5]!r}); this one reads {_MAGIC[:5]!r}"
        )
    if not data.startswith(_MAGIC):
        raise KVDataError("data is not a saved flashcodec cache (bad magic)")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if len(data) < len(_MAGIC) + 8 + _DIGEST or hashlib.sha256(body).digest() != digest:
        raise KVDataError(
            "data is a damaged saved flashcodec cache: its SHA-256 does not match (cut or changed)"
        )
    try:
        n = int.from_bytes(body[len(_MAGIC) : len(_MAGIC) + 8], "little")
        at = len(_MAGIC) + 8
        meta = json.loads(body[at : at + n])["layers"]
        at += n
    except (ValueError, KeyError, TypeError) as err:
        raise KVDataError(f"data is a damaged saved flashcodec cache: {err}") from None
    sizes = _check_layers(meta)
    if at + sum(size for *_, size in sizes) != len(body):
        raise KVDataError(
            f"data is a damaged saved flashcodec cache: its header describes {sum(s for *_, s in sizes)} bytes "
            f"of tensors, {len(body) - at} follow it"
        )
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for i, entry in enumerate(meta):
        if entry["empty"]:
            continue
        tensors = []
        for shape, dtype, size in entry["sizes"]:
            if size == 0:
                tensors.append(torch.empty(shape, dtype=getattr(torch, dtype)))
                continue
            packed = ExponentPacked.from_bytes(body[at : at + size])
            at += size
            tensor = ExponentCoder.decode(packed)
            if list(tensor.shape) != shape or str(tensor.dtype).removeprefix("torch.") != dtype:
                raise KVDataError(
                    f"data is a damaged saved flashcodec cache: layer {i} decodes to {tuple(tensor.shape)} "
                    f"{tensor.dtype}, its header says {tuple(shape)} {dtype}"
                )
            tensors.append(tensor)
        cache.update(tensors[0].to(device), tensors[1].to(device), i)
    return cache


_DTYPES = {str(d).removeprefix("torch.") for d in FORMATS}


def _check_layers(meta: Any) -> list[tuple[list[int], str, int]]:
    """Every ``(shape, dtype, size)`` the header ``meta`` lists, after checking its layout:
    KVDataError naming what is wrong."""
    where = "data is a damaged saved flashcodec cache:"
    if not isinstance(meta, list):
        raise KVDataError(f"{where} 'layers' must be a list; got {type(meta).__name__}")
    out = []
    for i, entry in enumerate(meta):
        if not isinstance(entry, dict) or not isinstance(entry.get("empty"), bool):
            raise KVDataError(
                f"{where} layer {i} must be an object with a boolean 'empty'; got {entry!r:.80}"
            )
        if entry["empty"]:
            continue
        sizes = entry.get("sizes")
        if not isinstance(sizes, list) or len(sizes) != 2:
            raise KVDataError(
                f"{where} layer {i} must list 'sizes' of its keys and values; got {sizes!r:.80}"
            )
        for item in sizes:
            ok = isinstance(item, list) and len(item) == 3
            shape, dtype, size = item if ok else (None, None, None)
            ok = ok and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
            ok = ok and dtype in _DTYPES and type(size) is int and size >= 0
            if not ok:
                raise KVDataError(
                    f"{where} layer {i} has a size entry {item!r:.80}; allowed: [shape (list of ints), one of "
                    f"{sorted(_DTYPES)}, byte count >= 0]"
                )
            out.append((shape, dtype, size))
    return out


def save_cache(cache: Any, path: str | os.PathLike, *, group: int = 64, level: int = 6) -> int:
    """Write ``cache`` losslessly to ``path`` (:func:`cache_to_bytes`); returns the bytes written."""
    data = cache_to_bytes(cache, group=group, level=level)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def load_cache(path: str | os.PathLike, *, config: Any = None, device: torch.device | str = "cpu") -> Any:
    """The ``DynamicCache`` saved at ``path`` (:func:`cache_from_bytes`)."""
    with open(path, "rb") as f:
        return cache_from_bytes(f.read(), config=config, device=device)
