"""The checksum palu-mlx's files carry: sha256 over their arrays and their metadata texts.

Safetensors has no integrity check of its own: a flipped byte in an array's data loads as a
different number. ``save_prompt_cache`` and ``Calibration.save`` write this digest into the
file's metadata and the loaders require it and recompute it, so corruption on disk or in transit is reported
with the file's name instead of becoming wrong attention outputs. It guards against accidents,
not against someone who rewrites the digest too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import mlx.core as mx

__all__ = ["CHECKSUM_KEY", "digest"]

#: metadata key of the digest, ``"sha256:<hex>"``
CHECKSUM_KEY = "checksum"


def digest(arrays: Mapping[str, mx.array], texts: Mapping[str, str]) -> str:
    """``"sha256:<hex>"`` over every array (name, dtype, shape, bytes, by name) and every text.

    Names, dtypes and shapes are hashed with the bytes so that a renamed or reshaped array
    with the same bytes does not pass.
    """
    h = hashlib.sha256()
    for name in sorted(arrays):
        arr = mx.contiguous(arrays[name])
        h.update(f"array\0{name}\0{arr.dtype}\0{tuple(arr.shape)}\0".encode())
        if arr.size:
            h.update(memoryview(arr))
    for name in sorted(texts):
        h.update(f"text\0{name}\0".encode())
        h.update(texts[name].encode("utf-8"))
    return "sha256:" + h.hexdigest()
