"""Save a transformers K/V cache losslessly in fewer bytes, and load it back.

    from flashcodec.hf.saved import save_cache, load_cache
    nbytes = save_cache(cache, "prompt.fckv")          # a DynamicCache after a prefill
    cache = load_cache("prompt.fckv", config=model.config)
    model.generate(ids, cache=cache, ...)             # the same tokens as with the original cache

Two coders, chosen with ``coder=`` and recorded in the file (the loader reads either):

* ``"exponent"`` (the default): every layer's keys and values go through
  :class:`flashcodec.codecs.lossless.ExponentCoder` (exponent codes against a per-(group, channel)
  maximum, zlib-compressed; sign and mantissa bits as they are). Fast to load (about 200 MB/s
  on one thread; saving about 15 MB/s, mostly its zlib pass).
* ``"context"``: :class:`flashcodec.codecs.lossless_context.ContextCoder` (adaptive context models
  of each channel's exponent and sign / top mantissa bits, range-coded; needs the ``lossless``
  extra, ``constriction``). About 8% fewer bytes than ``"exponent"`` on the real model's bf16
  cache, but much slower to load (under 10 MB/s), so it is for caches written once and kept. All
  tensors of one length and dtype (every layer's keys and values, usually) are coded together,
  as one model over all their channels.

Either way the loaded tensors equal the saved ones bit for bit. The file is smaller than the
cache's raw bytes for bf16 K/V (see ``docs/flashcodec.md`` for the ratios measured on the real
model); fp16 K/V shrink less, having three more mantissa bits, which are close to random.

Layers saved: every layer with ``keys`` / ``values`` tensors (``DynamicLayer``, sliding-window
layers); a layer holding anything else (linear-attention state) is refused with ``KVConfigError``.

The file: a magic line, the header's length and the header (JSON: the coder, and per layer each
tensor's shape, dtype and byte count, or for ``"context"`` the coded block holding it and the
blocks' byte counts), the coded tensors, and a SHA-256 of everything before it. ``"exponent"``
files start ``FCKV2`` (as before the coder was recorded: files without the field are read as
``"exponent"``), ``"context"`` files ``FCKV3``, so a reader that predates the context coder says
the file is of another format instead of misreading it. Loading checks the digest first, then the
coder, then that the header describes exactly the bytes that follow, so a flipped byte, a cut file
or an edited header is a ``KVDataError``, never a different cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from kvspec import KVConfigError, KVDataError, KVDtypeError

from ..codecs.lossless import FORMATS, ExponentCoder, ExponentPacked
from ..codecs.lossless_context import ContextCoder

__all__ = ["save_cache", "load_cache", "cache_to_bytes", "cache_from_bytes", "CODERS"]

_MAGIC = b"FCKV2\n"
#: the magic of a file whose tensors are coded by :class:`ContextCoder`
_MAGIC_CONTEXT = b"FCKV3\n"
#: the coders a file can be written with, each with its magic line
CODERS = {"exponent": _MAGIC, "context": _MAGIC_CONTEXT}
#: bytes of the SHA-256 that ends the file
_DIGEST = 32


def cache_to_bytes(
    cache: Any, *, coder: str = "exponent", group: int | None = None, level: int | None = None
) -> bytes:
    """The bytes :func:`save_cache` writes: ``cache``'s layers (transformers ``Cache`` with
    ``layers`` whose ``keys`` / ``values`` are bf16 or fp16 ``[B, H, S, D]``), each coded losslessly.

    Args:
        coder: ``"exponent"`` (default) or ``"context"`` (see the module docstring).
        group, level: the exponent coder's tokens per group (default 64) and zlib level (0-9,
            default 6); ``coder="context"`` takes neither.
    """
    if coder not in CODERS:
        raise KVConfigError(f"coder must be one of {sorted(CODERS)}; got {coder!r}")
    if coder == "context" and (group is not None or level is not None):
        raise KVConfigError(
            "group and level set the exponent coder; coder='context' takes neither (leave them unset)"
        )
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, (list, tuple)):
        raise KVConfigError(f"cache must be a transformers Cache with .layers; got {type(cache).__name__}")
    tensors: list[torch.Tensor] = []  # the non-empty ones, in file order
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
            # the third field, the byte count (exponent) or block (context), is filled in below
            entry["sizes"].append([list(t.shape), str(t.dtype).removeprefix("torch."), 0])
            if t.numel():
                tensors.append(t.detach().cpu())
        meta.append(entry)
    items = [item for entry in meta if not entry["empty"] for item in entry["sizes"] if _numel(item[0])]
    if coder == "exponent":
        exponent = ExponentCoder(64 if group is None else group)
        blobs = [exponent.encode(t).to_bytes(6 if level is None else level) for t in tensors]
        for item, blob in zip(items, blobs, strict=True):
            item[2] = len(blob)
        header = {"coder": coder, "layers": meta}
    else:
        blocks = _context_blocks(items)
        blobs = [ContextCoder().encode_many([tensors[j] for j in members]) for members in blocks]
        for b, members in enumerate(blocks):
            for j in members:
                items[j][2] = b
        header = {"coder": coder, "layers": meta, "blocks": [len(blob) for blob in blobs]}
    text = json.dumps(header).encode()
    body = b"".join([CODERS[coder], len(text).to_bytes(8, "little"), text, *blobs])
    return body + hashlib.sha256(body).digest()


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _context_blocks(items: list[list[Any]]) -> list[list[int]]:
    """Which non-empty tensors (indices into ``items``, ``[shape, dtype, _]`` in file order) the
    context coder codes together: one block per (length, dtype), in order of first appearance,
    so that a model step covers as many channels as it can. The loader recomputes it."""
    blocks: dict[tuple[int, str], list[int]] = {}
    for j, (shape, dtype, _) in enumerate(items):
        blocks.setdefault((shape[-2], dtype), []).append(j)
    return list(blocks.values())


def cache_from_bytes(data: bytes, *, config: Any = None, device: torch.device | str = "cpu") -> Any:
    """A transformers ``DynamicCache`` (laid out from ``config`` when given) holding exactly the
    keys and values in ``data`` (from :func:`cache_to_bytes`, either coder), on ``device``."""
    from transformers import DynamicCache

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise KVDtypeError(f"data must be bytes; got {type(data).__name__}")
    data = bytes(data)
    magic = data[: len(_MAGIC)]
    coder = {m: name for name, m in CODERS.items()}.get(magic)
    if coder is None and data.startswith(b"FCKV"):
        raise KVDataError(
            f"data is a saved flashcodec cache of another format ({data[:5]!r}); this one reads "
            f"{sorted(m[:5] for m in CODERS.values())}"
        )
    if coder is None:
        raise KVDataError("data is not a saved flashcodec cache (bad magic)")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if len(data) < len(magic) + 8 + _DIGEST or hashlib.sha256(body).digest() != digest:
        raise KVDataError(
            "data is a damaged saved flashcodec cache: its SHA-256 does not match (cut or changed)"
        )
    try:
        n = int.from_bytes(body[len(magic) : len(magic) + 8], "little")
        at = len(magic) + 8
        header = json.loads(body[at : at + n])
        meta = header["layers"]
        at += n
    except (ValueError, KeyError, TypeError) as err:
        raise KVDataError(f"data is a damaged saved flashcodec cache: {err}") from None
    # files written before the coder was recorded are all exponent-coded FCKV2
    written_by = header.get("coder", "exponent" if coder == "exponent" else None)
    if written_by != coder:
        raise KVDataError(
            f"data is a damaged saved flashcodec cache: its magic {magic[:5]!r} is written by coder "
            f"{coder!r}, its header names coder {written_by!r} (allowed: {sorted(CODERS)})"
        )
    items = _check_layers(meta)
    if coder == "exponent":
        tensors = _exponent_tensors(items, body, at)
    else:
        tensors = _context_tensors(items, header.get("blocks"), body, at)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    j = 0
    for i, entry in enumerate(meta):
        if entry["empty"]:
            continue
        pair = []
        for shape, dtype, _ in entry["sizes"]:
            tensor = tensors[j]
            j += 1
            if list(tensor.shape) != shape or str(tensor.dtype).removeprefix("torch.") != dtype:
                raise KVDataError(
                    f"data is a damaged saved flashcodec cache: layer {i} decodes to {tuple(tensor.shape)} "
                    f"{tensor.dtype}, its header says {tuple(shape)} {dtype}"
                )
            pair.append(tensor)
        cache.update(pair[0].to(device), pair[1].to(device), i)
    return cache


def _exponent_tensors(items: list[tuple[list[int], str, int]], body: bytes, at: int) -> list[torch.Tensor]:
    """Every tensor ``items`` lists, from the exponent-coded bytes ``body[at:]``."""
    where = "data is a damaged saved flashcodec cache:"
    for shape, _, size in items:
        if (size == 0) != (_numel(shape) == 0):
            raise KVDataError(f"{where} a tensor of shape {shape} is listed with {size} bytes")
    if at + sum(size for *_, size in items) != len(body):
        raise KVDataError(
            f"{where} its header describes {sum(s for *_, s in items)} bytes of tensors, {len(body) - at} follow it"
        )
    out = []
    for shape, dtype, size in items:
        if size == 0:
            out.append(torch.empty(shape, dtype=getattr(torch, dtype)))
            continue
        out.append(ExponentCoder.decode(ExponentPacked.from_bytes(body[at : at + size])))
        at += size
    return out


def _context_tensors(
    items: list[tuple[list[int], str, int]], blocks: Any, body: bytes, at: int
) -> list[torch.Tensor]:
    """Every tensor ``items`` lists, from the context-coded blocks ``body[at:]`` of byte counts ``blocks``."""
    where = "data is a damaged saved flashcodec cache:"
    full = [j for j, (shape, _, _) in enumerate(items) if _numel(shape)]
    for j in full:
        if len(items[j][0]) < 2:
            raise KVDataError(f"{where} a tensor of shape {items[j][0]} is not [..., S, D]")
    members = _context_blocks([list(items[j]) for j in full])
    if not (isinstance(blocks, list) and all(type(b) is int and b >= 0 for b in blocks)):
        raise KVDataError(f"{where} 'blocks' must list byte counts (ints >= 0); got {blocks!r:.80}")
    if len(blocks) != len(members):
        raise KVDataError(
            f"{where} its tensors make {len(members)} blocks (one per length and dtype), 'blocks' lists {len(blocks)}"
        )
    for b, group in enumerate(members):
        for m in group:
            if items[full[m]][2] != b:
                raise KVDataError(f"{where} a tensor of block {b} is listed in block {items[full[m]][2]}")
    if at + sum(blocks) != len(body):
        raise KVDataError(
            f"{where} its header describes {sum(blocks)} bytes of tensors, {len(body) - at} follow it"
        )
    out: list[torch.Tensor | None] = [
        None if _numel(shape) else torch.empty(shape, dtype=getattr(torch, dtype))
        for shape, dtype, _ in items
    ]
    for size, group in zip(blocks, members, strict=True):
        decoded = ContextCoder.decode_many(body[at : at + size])
        at += size
        if len(decoded) != len(group):
            raise KVDataError(
                f"{where} a block decodes to {len(decoded)} tensors, its header lists {len(group)}"
            )
        for m, tensor in zip(group, decoded, strict=True):
            out[full[m]] = tensor
    return out


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
                    f"{sorted(_DTYPES)}, byte count (exponent) or block (context) >= 0]"
                )
            out.append((shape, dtype, size))
    return out


def save_cache(
    cache: Any,
    path: str | os.PathLike,
    *,
    coder: str = "exponent",
    group: int | None = None,
    level: int | None = None,
) -> int:
    """Write ``cache`` losslessly to ``path`` (:func:`cache_to_bytes`: ``coder`` is ``"exponent"``
    or ``"context"``); returns the bytes written."""
    data = cache_to_bytes(cache, coder=coder, group=group, level=level)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def load_cache(path: str | os.PathLike, *, config: Any = None, device: torch.device | str = "cpu") -> Any:
    """The ``DynamicCache`` saved at ``path`` (:func:`cache_from_bytes`)."""
    with open(path, "rb") as f:
        return cache_from_bytes(f.read(), config=config, device=device)
