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

:func:`model_rotaries` decides, per layer, whether a model can use this path: its
architecture must be one whose attention was read to follow ``q/k/v -> norm -> RoPE(offset =
cache.offset) -> cache -> SDPA`` (:data:`PRE_ROPE_ARCHITECTURES`), and its RoPE module must
be a plain per-pair rotation with angles linear in the position (checked numerically by
probing the module, which also recovers the frequencies: scaled variants such as llama3's
are covered; YaRN's magnitude scaling or dynamic NTK are not, and fall back). Anything else
falls back to caching post-RoPE keys with a :class:`PreRopeFallbackWarning` naming the
architecture.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["Rotary", "PreRopeFallbackWarning", "PRE_ROPE_ARCHITECTURES", "model_rotaries", "probe_rotary"]

#: mlx-lm ``model_type``\ s whose attention calls ``rope(keys, offset=cache.offset)`` right
#: before ``cache.update_and_fetch`` and feeds the returned keys straight to SDPA (read in
#: mlx-lm's ``llama.py``, ``qwen2.py``, ``qwen3.py``, ``qwen2_moe.py``, ``qwen3_moe.py``;
#: mistral checkpoints load through ``llama.py``).
PRE_ROPE_ARCHITECTURES: frozenset[str] = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"}
)

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


def model_rotaries(model: Any, head_dim: int | None) -> list[Rotary | None] | None:
    """One :class:`Rotary` per layer of ``model`` for the pre-RoPE path, or None with a warning.

    Returns None (and warns :class:`PreRopeFallbackWarning`, naming the architecture and why)
    when the architecture is not in :data:`PRE_ROPE_ARCHITECTURES` or a layer's
    ``self_attn.rope`` is not a rotation palu can invert.
    """
    arch = _architecture(model)
    reason = None
    rotaries: list[Rotary | None] = []
    if arch not in PRE_ROPE_ARCHITECTURES:
        reason = f"its attention is not one of {', '.join(sorted(PRE_ROPE_ARCHITECTURES))}"
    elif head_dim is None:
        reason = "its head dim is unknown"
    else:
        for i, layer in enumerate(getattr(model, "layers", [])):
            rope = getattr(getattr(layer, "self_attn", None), "rope", None)
            rotary = None if rope is None else probe_rotary(rope, head_dim)
            if rotary is None:
                reason = (
                    f"layer {i}'s RoPE ({type(rope).__name__}) is not a plain rotation linear in the position"
                )
                break
            rotaries.append(rotary)
    if reason is not None:
        warnings.warn(
            f"palu: architecture {arch!r} does not support the pre-RoPE path ({reason}); "
            "caching keys after RoPE instead (lower quality at the same bytes)",
            PreRopeFallbackWarning,
            stacklevel=3,
        )
        return None
    return rotaries
