"""The pre-RoPE path: palu codes keys as they were before the rotary embedding.

mlx-lm's attention families (llama, mistral, qwen2, qwen3, ...) rotate keys with RoPE at
positions ``cache.offset + i`` and then hand them to ``cache.update_and_fetch``. Rotated keys
spread their energy over many directions (on the embedded model a 90%-energy rank of 23-33 of
64 per KV head, against 4-9 before RoPE), so a low-rank projection of them keeps little.

A palu cache built with a :class:`Rotary` takes keys back to before RoPE as they arrive
(the rotation at position ``p`` is orthogonal; its inverse is the rotation at ``-p``, computed in
float32), fits and codes the pre-RoPE keys, and rotates the reconstructed keys at their true
positions ``0 .. offset-1`` for each attention call. No module of the model is touched: the
model's own RoPE, queries and attention run unchanged, installing and removing palu only
changes which caches the model gets, and the cache carries its rotation (the per-pair
frequencies) in its state, so a saved prompt cache needs no model to reload.

:func:`model_rotaries` decides per layer, by the mechanism rather than the architecture's name
(:func:`layer_rotary`): the layer's attention runs on a probe input with stand-in caches at two
offsets, and the keys it hands to ``cache.update_and_fetch`` must either not move with the offset
(no RoPE, as SmolLM3's NoPE layers: nothing to undo) or be its ``rope`` module's rotation at
positions ``cache.offset + i``, that module being a plain per-pair rotation with angles linear in
the position (checked numerically by probing it, which also recovers the frequencies and the
rotated channels: llama3's scaling and partial rotary are covered; YaRN's magnitude scaling or
dynamic NTK are not). A model with any other layer falls back to caching post-RoPE keys with a
:class:`PreRopeFallbackWarning` naming the architecture, the layer and the reason.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

__all__ = [
    "Rotary",
    "PreRopeFallbackWarning",
    "PRE_ROPE_ARCHITECTURES",
    "model_rotaries",
    "layer_rotary",
    "probe_rotary",
]

#: mlx-lm ``model_type``\ s whose tiny random-weight models the tests run on the pre-RoPE path
#: (mistral checkpoints load through llama's). The path is not decided by this list: every model's
#: layers are probed (:func:`layer_rotary`).
PRE_ROPE_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen2_moe",
        "qwen3_moe",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo2",
        "granite",
        "starcoder2",
        "smollm3",
        "cohere",
        "gpt_neox",
        "exaone",
    }
)

#: the probe's position and length: far enough along that every pair but the slowest turns visibly
_PROBE_OFFSET = 37
_PROBE_TOKENS = 3

# positions at which a probed rotation must match the recovered linear-in-position one
_CHECK_POSITIONS = (0, 1, 7, 300, 4099)


class PreRopeFallbackWarning(UserWarning):
    """A model's keys are cached after RoPE because palu's pre-RoPE path does not support it."""


@dataclass(frozen=True)
class Rotary:
    """A rotary embedding: pairs of the first ``dims`` channels rotated by ``position * inv_freq``.

    Attributes:
        inv_freq: ``[dims // 2]`` float32 angle per position of each channel pair.
        dims: channels rotated (the rest pass unchanged), even.
        traditional: pairs are adjacent channels ``(2j, 2j+1)`` when True, else ``(j, j + dims/2)``
            (mlx's two layouts).
    """

    inv_freq: mx.array
    dims: int
    traditional: bool

    def _rope(self, x: mx.array, offset: int, sign: float) -> mx.array:
        return mx.fast.rope(
            x.astype(mx.float32),
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=sign,
            offset=offset,
            freqs=1.0 / self.inv_freq,
        )

    def rotate(self, x: mx.array, offset: int = 0) -> mx.array:
        """RoPE of ``x [B, H, S, D]`` at positions ``offset .. offset+S-1``; float32 out."""
        return self._rope(x, offset, 1.0)

    def unrotate(self, x: mx.array, offset: int = 0) -> mx.array:
        """Inverse of :meth:`rotate` (the rotation by minus the angles); float32 out."""
        return self._rope(x, offset, -1.0)

    def to_meta(self) -> dict[str, Any]:
        """The JSON-able half (``inv_freq`` travels as an array in the cache state)."""
        return {"dims": self.dims, "traditional": self.traditional}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], inv_freq: mx.array) -> Rotary:
        return cls(
            inv_freq=inv_freq.astype(mx.float32),
            dims=int(meta["dims"]),
            traditional=bool(meta["traditional"]),
        )


def _pair_index(j: mx.array | np.ndarray, dims: int, traditional: bool) -> tuple[np.ndarray, np.ndarray]:
    j = np.asarray(j)
    return (2 * j, 2 * j + 1) if traditional else (j, j + dims // 2)


def probe_rotary(rope: Any, head_dim: int) -> Rotary | None:
    """Recover a :class:`Rotary` from a RoPE module ``rope(x, offset=p)``, or None if it is not one.

    Reads the module's public ``dims`` and ``traditional`` (``dims`` defaults to ``head_dim``),
    measures each pair's angle at position 1, and checks that random inputs at several
    positions (up to 4,099) come out as the same rotation with angles linear in the position
    and norms kept (float32, relative error below 1e-4).
    """
    dims = getattr(rope, "dims", head_dim)
    traditional = getattr(rope, "traditional", False)
    if (
        not isinstance(dims, int)
        or not isinstance(traditional, bool)
        or dims < 2
        or dims % 2
        or dims > head_dim
    ):
        return None
    half = dims // 2
    first, second = _pair_index(np.arange(half), dims, traditional)
    probe = np.zeros((1, half, 1, head_dim), dtype=np.float32)
    probe[0, np.arange(half), 0, first] = 1.0
    rows = np.arange(half)
    try:
        inv_freq = np.zeros(half)
        # Position 1 gives each angle unambiguously; farther positions refine it (the angle is
        # known up to 2 pi, resolved by the previous estimate), as float32 angles grow with p.
        for p in (1, 16, 256, 4096):
            out = np.array(rope(mx.array(probe), offset=p).astype(mx.float32)).astype(np.float64)
            angle = np.arctan2(out[0, rows, 0, second], out[0, rows, 0, first])
            turns = np.round((p * inv_freq - angle) / (2 * np.pi)) if p > 1 else 0.0
            inv_freq = (angle + 2 * np.pi * turns) / p
        rotary = Rotary(mx.array(inv_freq.astype(np.float32)), dims, traditional)
        x = mx.random.normal((1, 2, 3, head_dim), key=mx.random.key(7))
        for p in _CHECK_POSITIONS:
            theirs = rope(x, offset=p).astype(mx.float32)
            err = mx.linalg.norm(theirs - rotary.rotate(x, p)) / mx.linalg.norm(x)
            if not err.item() < 1e-4:
                return None
    except Exception:  # noqa: BLE001 - a module that cannot be probed is simply not supported
        return None
    return rotary


def _architecture(model: Any) -> str:
    args = getattr(model, "args", None)
    return str(
        getattr(args, "model_type", None) or getattr(model, "model_type", None) or type(model).__module__
    )


class _Unsupported(Exception):
    """A layer whose keys palu cannot take back to before RoPE (the message says why)."""


class _Recorded(Exception):
    """Ends a probe once the keys reached the cache: the rest of the attention is not needed (and
    under tensor parallel its output projection would be a collective)."""


class _RecordingCache:
    """Stands in for a layer's cache while its attention is probed: records the keys handed to it."""

    def __init__(self, offset: int):
        self.offset = offset
        self.keys: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = keys
        raise _Recorded


def _attention_of(layer: Any) -> Any:
    # the module owning a ``rope``, at any depth (exaone nests it in layer.attn.attention), else a
    # conventionally named one (an attention without RoPE, as ALiBi's, has none)
    named = getattr(layer, "named_modules", None)
    owners = [(n.count("."), n) for n, m in (named() if callable(named) else []) if _owns_rope(m)]
    if owners:
        return layer if min(owners)[1] == "" else _child(layer, min(owners)[1])
    for name in ("self_attn", "attention", "attn"):
        module = getattr(layer, name, None)
        if callable(module):
            return module
    raise _Unsupported("it has no attention module (one with a rope, or named self_attn, attention or attn)")


def _owns_rope(module: Any) -> bool:
    return callable(module) and getattr(module, "rope", None) is not None


def _child(module: Any, path: str) -> Any:
    for part in path.split("."):
        module = module[int(part)] if isinstance(module, list) else getattr(module, part)
    return module


def _probe_dtype(attn: Any) -> mx.Dtype:
    # the dtype the layer computes in: a quantized layer's scales, else its weights
    for _, value in tree_flatten(attn.parameters()):
        if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32


def _cached_keys(attn: Any, x: mx.array, offset: int) -> mx.array:
    cache = _RecordingCache(offset)
    try:
        attn(x, mask=None, cache=cache)
    except _Recorded:
        pass
    except Exception as exc:  # noqa: BLE001 - an attention that cannot be probed is not supported
        raise _Unsupported(f"its attention cannot be run on a probe ({type(exc).__name__}: {exc})") from None
    if cache.keys is None or cache.keys.ndim != 4:
        raise _Unsupported("its attention does not hand [B, H, S, D] keys to cache.update_and_fetch")
    return cache.keys.astype(mx.float32)


def _differ(a: mx.array, b: mx.array, tolerance: float) -> bool:
    return not (mx.linalg.norm(a - b) <= tolerance * mx.linalg.norm(b)).item()


def _rows_differ(keys: mx.array, tolerance: float) -> bool:
    return _differ(keys, mx.broadcast_to(keys[:, :, :1], keys.shape), tolerance)


def layer_rotary(layer: Any, hidden_size: int) -> Rotary | None:
    """The rotation to take ``layer``'s cached keys back to before RoPE: None when they need none.

    Verified on the mechanism, not the architecture's name: the layer's attention runs twice on
    one random token repeated, with stand-in caches at offsets 0 and :data:`_PROBE_OFFSET`, and the
    keys it hands to ``cache.update_and_fetch`` are compared. Keys alike at every position and
    offset (a layer without RoPE, as SmolLM3's NoPE layers) need no un-rotation: None. Otherwise
    they must be the layer's ``rope`` (a plain rotation, :func:`probe_rotary`) at positions
    ``cache.offset + i``: un-rotated at those positions, every probe row is the same pre-RoPE key.
    Anything else raises ``_Unsupported`` naming the reason.
    """
    attn = _attention_of(layer)
    dtype = _probe_dtype(attn)
    # one token at every position: its keys differ between rows only by what the position does
    token = mx.random.normal((1, 1, hidden_size), key=mx.random.key(11)).astype(dtype)
    x = mx.broadcast_to(token, (1, _PROBE_TOKENS, hidden_size))
    at_zero, moved = _cached_keys(attn, x, 0), _cached_keys(attn, x, _PROBE_OFFSET)
    # keys that went through 16 bits (a 16-bit layer, or a float32 one whose keys are rounded
    # before RoPE, as palu-mlx compare --compute-dtype float32 does; 2.6e-3 on SmolLM2) differ by a
    # few 2^-8: rounding, not a misfit (a wrong position or scale moves them by tens of per cent)
    tolerance = 3e-2
    if not _differ(moved, at_zero, tolerance) and not _rows_differ(at_zero, tolerance):
        return None
    rope = getattr(attn, "rope", None)
    rotary = None if rope is None else probe_rotary(rope, at_zero.shape[-1])
    if rotary is None:
        raise _Unsupported(
            f"its keys move with the position but its RoPE ({type(rope).__name__}) is not a plain "
            "rotation linear in the position"
        )
    before = rotary.unrotate(at_zero, 0)
    if _differ(rotary.unrotate(moved, _PROBE_OFFSET), before, tolerance) or _rows_differ(before, tolerance):
        raise _Unsupported("the keys it caches are not its RoPE's rotation at positions cache.offset + i")
    return rotary


def model_rotaries(model: Any, head_dim: int | None = None) -> list[Rotary | None] | None:
    """One entry per layer of ``model`` for the pre-RoPE path, or None with a warning.

    Each layer is verified by :func:`layer_rotary` (a :class:`Rotary`, or None for keys that carry
    no rotation). Returns None and warns :class:`PreRopeFallbackWarning`, naming the architecture,
    the first layer that fails and why, when any layer's keys cannot be taken back to before RoPE:
    then every layer caches the keys as the model gives them. ``head_dim`` is not needed (each
    layer's keys say theirs); it is accepted for the callers that pass it.
    """
    arch = _architecture(model)
    hidden_size = getattr(getattr(model, "args", None), "hidden_size", None)
    rotaries: list[Rotary | None] = []
    reason = None
    if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
        reason = "its hidden size (args.hidden_size) is unknown, so its attention cannot be probed"
    else:
        for i, layer in enumerate(getattr(model, "layers", None) or []):
            try:
                rotaries.append(layer_rotary(layer, hidden_size))
            except _Unsupported as exc:
                reason = f"layer {i}: {exc}"
                break
    if reason is not None:
        warnings.warn(
            f"palu: architecture {arch!r} does not support the pre-RoPE path ({reason}); "
            "caching keys after RoPE instead (lower quality at the same bytes)",
            PreRopeFallbackWarning,
            stacklevel=3,
        )
        return None
    return rotaries
