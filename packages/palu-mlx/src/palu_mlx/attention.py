"""Attention on palu's latent codes, and the switch that routes an mlx-lm model's attention to it.

A fitted palu cache holds, per KV head group ``g``, key latents ``L_k`` and value latents ``L_v``
with their projections (``K = L_k V_kᵀ + μ_k``, ``V = L_v V_vᵀ + μ_v``). The plain path rebuilds
the whole 16-bit history for every attention call and hands it to SDPA. Here instead:

* **Values stay in the latent domain.** Softmax weights sum to one, so
  ``p · (L_v V_vᵀ + μ_v) = (p · L_v) V_vᵀ + μ_v`` exactly: the weights multiply the ``r_v``-wide
  latents, and one ``[r_v, D]`` product per query row maps the result back. No value is ever
  rebuilt.
* **Keys are rebuilt chunk by chunk.** Pre-RoPE keys must be rotated at their own positions
  before the dot product with the (rotated) queries, so ``q · R_t (L V_kᵀ)`` does not factor
  through the latents; each chunk of ``chunk`` tokens is decoded, rebuilt, rotated and scored,
  and the chunks are combined with an online softmax (running max, running sum). Peak memory
  is one chunk of keys, not the history.

:func:`route_attention` makes an mlx-lm model use this: the model families whose attention
module calls ``mlx_lm.models.base.scaled_dot_product_attention`` through a module-level name
get that name replaced by :func:`routed_sdpa`, which sends calls whose cache offers a
:class:`LatentStore` here and every other call, unchanged, to mlx-lm's function. The model
object itself is not touched; :func:`unroute_attention` puts mlx-lm's function back. The
cache's ``update_and_fetch`` still returns the rebuilt history as lazy arrays (so anything that
reads them works); when the routed attention does not read them, MLX never computes them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import base as mlx_base

from .lowrank import GroupProjection, reconstruct
from .rope import Rotary

__all__ = ["LatentStore", "latent_attention", "routed_sdpa", "route_attention", "unroute_attention", "CHUNK"]

#: key tokens rebuilt at once. Measured on the embedded model at 2,048 and 8,192 tokens (bf16,
#: palu-1.5bit, this CPU): 256 with each chunk evaluated before the next keeps one decode step's
#: transient near 2.3 MB (about 9 KB per chunk token over the 4 KV heads), against 14 MB for
#: 1,024 without, and was no slower than either
CHUNK = 256

# masked scores: finite, so a chunk whose keys are all masked for a row gives exp(0)=1 terms
# that the next unmasked chunk's correction factor exp(-1e30 - m) wipes out (no NaN)
_MASKED = -1e30


@dataclass(frozen=True)
class LatentStore:
    """What :func:`latent_attention` reads from a cache: ``length`` tokens of latent codes.

    Attributes:
        heads: KV heads ``H``.
        length: tokens held.
        key_latents: ``(start, stop) -> [B, H, stop-start, r_k]`` float32 key latents.
        key_projection: the keys' per-group projection.
        rotary: the RoPE to apply to rebuilt keys at their positions (pre-RoPE keys), or None.
        value_latents: ``(start, stop) -> [B, H, stop-start, r_v]`` float32 value latents.
        value_projection: the values' per-group projection.
        exact_keys: ``[B, H, m, D]`` keys of the first ``m`` tokens held exactly, as attention
            uses them (rotated), or None; those tokens are read from here, not from the codes.
        exact_values: ``[B, H, m, Dv]`` their values, or None.
        recent_keys: ``[B, H, n, D]`` keys of the newest tokens ``recent_start .. length - 1`` held
            exactly (rotated), or None; read from here, not from the codes.
        recent_values: ``[B, H, n, Dv]`` their values, or None.
        recent_start: the first of those tokens (``length`` when there are none).
    """

    heads: int
    length: int
    key_latents: Callable[[int, int], mx.array]
    key_projection: GroupProjection
    rotary: Rotary | None
    value_latents: Callable[[int, int], mx.array]
    value_projection: GroupProjection
    exact_keys: mx.array | None = None
    exact_values: mx.array | None = None
    recent_keys: mx.array | None = None
    recent_values: mx.array | None = None
    recent_start: int | None = None

    @property
    def coded_stop(self) -> int:
        """End of the tokens read from the codes (where the exact newest tokens begin)."""
        return self.length if self.recent_keys is None else self.recent_start

    @property
    def exact(self) -> int:
        """Tokens at the start read exactly (0 without an exact prefix)."""
        return 0 if self.exact_keys is None else self.exact_keys.shape[2]

    def keys(self, start: int, stop: int) -> mx.array:
        """Rebuilt keys of tokens ``[start, stop)``, rotated at their positions, float32."""
        keys = reconstruct(self.key_latents(start, stop), self.key_projection, mx.float32)
        return keys if self.rotary is None else self.rotary.rotate(keys, start)


def _chunk_mask(mask: Any, start: int, stop: int, n_queries: int, length: int, rep: int) -> mx.array | None:
    """The mask of key tokens ``[start, stop)`` as a bool array broadcastable to ``[B, H, rep, L, c]``.

    ``mask`` is what mlx-lm passes to SDPA: None, ``"causal"``, or an array broadcastable to
    ``[B, Hq, L, length]`` (bool: True attends; float: added to the scores, returned as such).
    """
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask={mask!r}: the only string mask is 'causal'")
        query_pos = mx.arange(length - n_queries, length)[:, None]
        return mx.arange(start, stop)[None, :] <= query_pos  # [L, c]
    m = mask[..., start:stop]
    while m.ndim < 4:
        m = m[None]
    b, h = m.shape[0], m.shape[1]
    # [B?, Hq?, L?, c] -> [B?, H?, rep?, L?, c] (query heads are grouped by KV head, as in SDPA)
    return m.reshape(b, h // rep, rep, *m.shape[2:]) if h > 1 else m[:, :, None]


def latent_attention(
    queries: mx.array, store: LatentStore, scale: float, mask: Any = None, chunk: int = CHUNK
) -> mx.array:
    """Scaled dot-product attention of ``queries [B, Hq, L, D]`` over ``store``'s tokens.

    Equals ``softmax(q kᵀ * scale + mask) v`` with the rebuilt keys and values (up to float32
    rounding); ``Hq`` must be a multiple of the KV head count (grouped-query attention).
    Returns ``[B, Hq, L, Dv]`` in the queries' dtype.
    """
    b, hq, n_q, d = queries.shape
    h = store.heads
    rep = hq // h
    rows = rep * n_q
    q = (queries.astype(mx.float32) * scale).reshape(b, h, rows, d)
    # the running max starts at the masked-score floor and the sums at zero, so the first chunk
    # goes through the same update as every other (its correction factor is exp(floor - max) = 0)
    running_max, running_sum, acc = mx.array(_MASKED), mx.array(0.0), mx.array(0.0)
    # the exact prefix (attention sinks) is one more chunk whose values are full rows, not latents
    exact_sum, exact_acc = mx.array(0.0), mx.array(0.0)
    m = store.exact
    if m:
        scores = _masked_scores(
            q @ store.exact_keys.astype(mx.float32).swapaxes(-1, -2), mask, 0, m, store, b, rep, n_q
        )
        running_max = mx.maximum(running_max, mx.max(scores, axis=-1, keepdims=True))
        p = mx.exp(scores - running_max)
        exact_sum = mx.sum(p, axis=-1, keepdims=True)
        exact_acc = p @ store.exact_values.astype(mx.float32)
    coded_stop = store.coded_stop
    several = coded_stop - m > chunk
    for start in range(m, coded_stop, chunk):
        stop = min(coded_stop, start + chunk)
        scores = q @ store.keys(start, stop).swapaxes(-1, -2)  # [B, H, rows, c]
        scores = _masked_scores(scores, mask, start, stop, store, b, rep, n_q)
        new_max = mx.maximum(running_max, mx.max(scores, axis=-1, keepdims=True))
        p = mx.exp(scores - new_max)
        correction = mx.exp(running_max - new_max)
        running_sum = running_sum * correction + mx.sum(p, axis=-1, keepdims=True)
        acc = acc * correction + p @ store.value_latents(start, stop)
        if m:
            exact_sum, exact_acc = exact_sum * correction, exact_acc * correction
        running_max = new_max
        if several:
            # MLX would otherwise build every chunk's graph and may hold all their transients at
            # once; evaluating chunk by chunk keeps one chunk's keys alive (a sync point, so a
            # model wrapped in mx.compile cannot run multi-chunk attention)
            mx.eval(running_max, running_sum, acc)
    recent = store.recent_keys is not None and coded_stop < store.length
    if recent:
        # the newest tokens, exact: one more chunk whose values are full rows
        scores = q @ store.recent_keys.astype(mx.float32).swapaxes(-1, -2)
        scores = _masked_scores(scores, mask, coded_stop, store.length, store, b, rep, n_q)
        new_max = mx.maximum(running_max, mx.max(scores, axis=-1, keepdims=True))
        p = mx.exp(scores - new_max)
        correction = mx.exp(running_max - new_max)
        running_sum = running_sum * correction
        acc = acc * correction
        exact_sum = exact_sum * correction + mx.sum(p, axis=-1, keepdims=True)
        exact_acc = exact_acc * correction + p @ store.recent_values.astype(mx.float32)
        running_max = new_max
    if m or recent:
        # (p L_v) V_vᵀ + μ_v Σp for the coded tokens, plus p·v for the exact ones, over all weights
        safe = mx.maximum(running_sum, 1e-30)
        coded = reconstruct(
            mx.broadcast_to(acc / safe, (b, h, rows, store.value_projection.rank)),
            store.value_projection,
            mx.float32,
        )
        out = (coded * running_sum + exact_acc) / (running_sum + exact_sum)
    else:
        latent_out = acc / running_sum  # [B, H, rows, r_v]
        # back to values: (p L_v) V_vᵀ + μ_v, per head group (the heads of a group share a projection)
        out = reconstruct(latent_out, store.value_projection, mx.float32)  # [B, H, rows, Dv]
    return out.reshape(b, hq, n_q, out.shape[-1]).astype(queries.dtype)


def _masked_scores(
    scores: mx.array, mask: Any, start: int, stop: int, store: LatentStore, b: int, rep: int, n_q: int
) -> mx.array:
    """``scores [B, H, rows, c]`` of key tokens ``[start, stop)`` with ``mask`` applied."""
    m = _chunk_mask(mask, start, stop, n_q, store.length, rep)
    if m is None:
        return scores
    h, rows = scores.shape[1], scores.shape[2]
    s5 = scores.reshape(b, h, rep, n_q, stop - start)
    if m.dtype == mx.bool_:
        s5 = mx.where(m, s5, _MASKED)
    else:  # additive; -inf entries are floored like boolean ones (no inf - inf = NaN)
        s5 = mx.maximum(s5 + m.astype(mx.float32), _MASKED)
    return s5.reshape(b, h, rows, stop - start)


# --------------------------------------------------------------------------- routing
_MLX_SDPA = mlx_base.scaled_dot_product_attention
_ROUTED_NAME = "scaled_dot_product_attention"


def routed_sdpa(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention`` with calls on latent palu caches sent to the codes."""
    latent_store = getattr(cache, "latent_store", None)
    if sinks is None and latent_store is not None:
        store = latent_store()
        if store is not None:
            return latent_attention(queries, store, scale, mask)
    return _MLX_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _attention_modules(model: Any) -> list[Any]:
    modules = []
    for layer in getattr(model, "layers", None) or []:
        attn = getattr(layer, "self_attn", None)
        module = sys.modules.get(type(attn).__module__) if attn is not None else None
        if module is not None and module not in modules:
            modules.append(module)
    return modules


def route_attention(model: Any) -> bool:
    """Send ``model``'s attention on latent palu caches to :func:`latent_attention`.

    Replaces the module-level ``scaled_dot_product_attention`` of the modules defining the
    model's attention layers, where it is mlx-lm's own function (so every other cache and every
    other call behaves exactly as before). Returns whether the model's attention is routed
    (False for a family that calls attention some other way: it keeps rebuilding the history).
    """
    routed = False
    for module in _attention_modules(model):
        current = getattr(module, _ROUTED_NAME, None)
        if current is _MLX_SDPA:
            setattr(module, _ROUTED_NAME, routed_sdpa)
            current = routed_sdpa
        routed = routed or current is routed_sdpa
    return routed


def unroute_attention(model: Any) -> bool:
    """Undo :func:`route_attention` for ``model``'s families; returns whether anything was routed."""
    undone = False
    for module in _attention_modules(model):
        if getattr(module, _ROUTED_NAME, None) is routed_sdpa:
            setattr(module, _ROUTED_NAME, _MLX_SDPA)
            undone = True
    return undone
