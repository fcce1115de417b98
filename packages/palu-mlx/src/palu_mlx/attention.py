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
* **Packed rows are unpacked here, for all heads at once.** When the store hands over the packed
  rows of fixed quantizers (:class:`PackedRows`, the ``palu_bits`` coders), a chunk's codes are
  read with one float32 product that gathers each channel's two bytes (exact: integers below
  2^16), one cast, one mask; the quantizer steps and the offsets are folded into the key
  projection and applied to the value sums once, and RoPE is applied as two products with a
  cosine and a sine table of the chunk's token offsets (the chunk's start angle goes into the
  queries), so no transcendental runs per step. The codes are never turned into latents and the
  values never rebuilt.

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
import numpy as np
from kvspec import KVConfigError, KVDataError
from mlx_lm.models import base as mlx_base

from .coders.fixed import read_scales, scale_bytes
from .lowrank import GroupProjection, reconstruct
from .rope import Rotary

__all__ = [
    "LatentStore",
    "PackedRows",
    "latent_attention",
    "routed_sdpa",
    "route_attention",
    "unroute_attention",
    "CHUNK",
    "PACKED_CHUNK",
]

#: key tokens rebuilt at once. Measured on the embedded model at 2,048 and 8,192 tokens (bf16,
#: palu-1.5bit, this CPU): 256 with each chunk evaluated before the next keeps one decode step's
#: transient near 2.3 MB (about 9 KB per chunk token over the 4 KV heads), against 14 MB for
#: 1,024 without, and was no slower than either
CHUNK = 256

#: key tokens unpacked at once on the packed path (:class:`PackedRows`) for decode queries:
#: ``benchmarks/palu/decode_speed.py`` runs 512, 1,024 and 2,048 on the real model (tokens/s and
#: one step's transient; larger chunks were no faster and hold more)
PACKED_CHUNK = 1024
#: score elements per head a packed chunk may hold (float32: 1 MiB): a long query block (prefill)
#: reads fewer tokens at once, down to :data:`CHUNK`, so its transient stays near the latents path's
_SCORES_PER_CHUNK = 1 << 18

# masked scores: finite, so a chunk whose keys are all masked for a row gives exp(0)=1 terms
# that the next unmasked chunk's correction factor exp(-1e30 - m) wipes out (no NaN)
_MASKED = -1e30

#: entries kept by each of the small memos below (layouts and RoPE tables; cleared when full)
_MAX_MEMO = 64


@dataclass(frozen=True)
class PackedRows:
    """One tensor's codes as :class:`~palu_mlx.coders.fixed.FixedQuantCoder` packs them.

    Attributes:
        rows: ``[B, H, n, bytes]`` uint8 with ``n`` at least the store's ``length`` (a grown
            buffer; rows past ``length`` are never read): per token and head, with
            ``token_scale`` a bfloat16 scale in the first two bytes, then the codes of the
            channels, ``widths[c]`` bits each, packed from the lowest bit of the first byte on.
        widths: bits of each latent channel, 1 to 8.
        steps: ``[H, r]`` float32 quantizer steps; a code ``c`` of width ``w`` is the latent
            ``(c + 0.5 - 2^w / 2) * step`` (times the row's scale).
        token_scale: whether rows start with the scale.
        scale_bits: how the scale is stored (:func:`~palu_mlx.coders.fixed.store_scales`): 16, a
            bfloat16 in two bytes; 8, a one-byte log code.
    """

    rows: mx.array
    widths: tuple[int, ...]
    steps: mx.array
    token_scale: bool
    scale_bits: int = 16


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
        packed_keys: the key codes as packed rows, or None; with ``packed_values`` it lets
            :func:`latent_attention` unpack them itself (the packed path) instead of calling
            ``key_latents`` / ``value_latents``.
        packed_values: the value codes as packed rows, or None.
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
    packed_keys: PackedRows | None = None
    packed_values: PackedRows | None = None

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
            raise KVConfigError(f"mask={mask!r}: the only string mask is 'causal'")
        query_pos = mx.arange(length - n_queries, length)[:, None]
        return mx.arange(start, stop)[None, :] <= query_pos  # [L, c]
    m = mask[..., start:stop]
    while m.ndim < 4:
        m = m[None]
    b, h = m.shape[0], m.shape[1]
    # [B?, Hq?, L?, c] -> [B?, H?, rep?, L?, c] (query heads are grouped by KV head, as in SDPA)
    return m.reshape(b, h // rep, rep, *m.shape[2:]) if h > 1 else m[:, :, None]


def latent_attention(
    queries: mx.array,
    store: LatentStore,
    scale: float,
    mask: Any = None,
    chunk: int | None = None,
    packed: bool | None = None,
) -> mx.array:
    """Scaled dot-product attention of ``queries [B, Hq, L, D]`` over ``store``'s tokens.

    Equals ``softmax(q kᵀ * scale + mask) v`` with the rebuilt keys and values (up to float32
    rounding); ``Hq`` must be a multiple of the KV head count (grouped-query attention).
    ``chunk``: key tokens read at once (None: :data:`PACKED_CHUNK` on the packed path, fewer
    for long query blocks, down to :data:`CHUNK`; :data:`CHUNK` otherwise). ``packed``: None reads the packed rows when the store has them
    (:class:`PackedRows`), else the latents; False always reads the latents; True requires
    the packed rows. Returns ``[B, Hq, L, Dv]`` in the queries' dtype.
    """
    has_packed = store.packed_keys is not None and store.packed_values is not None
    if packed is None:
        packed = has_packed
    elif not isinstance(packed, bool):
        raise TypeError(f"packed={packed!r} must be None, True or False")
    elif packed and not has_packed:
        raise KVConfigError("packed=True needs a store with packed_keys and packed_values; this one has none")
    rows = (queries.shape[1] // store.heads) * queries.shape[2]
    if chunk is None:
        chunk = min(PACKED_CHUNK, max(CHUNK, _SCORES_PER_CHUNK // rows)) if packed else CHUNK
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise KVConfigError(f"chunk={chunk!r} must be a positive int (key tokens read at once)")
    b, hq, n_q, d = queries.shape
    h = store.heads
    rep = hq // h
    rows = rep * n_q
    q = (queries.astype(mx.float32) * scale).reshape(b, h, rows, d)
    reader = _PackedReader(store, q, chunk) if packed else _LatentReader(store, q)
    # the running max starts at the masked-score floor and the sums at zero, so the first chunk
    # goes through the same update as every other (its correction factor is exp(floor - max) = 0)
    running_max, running_sum = mx.array(_MASKED), mx.array(0.0)
    accs = [mx.array(0.0) for _ in range(reader.n_acc)]
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
        scores = _masked_scores(reader.scores(start, stop), mask, start, stop, store, b, rep, n_q)
        new_max = mx.maximum(running_max, mx.max(scores, axis=-1, keepdims=True))
        p = mx.exp(scores - new_max)
        correction = mx.exp(running_max - new_max)
        running_sum = running_sum * correction + mx.sum(p, axis=-1, keepdims=True)
        accs = [
            acc * correction + part for acc, part in zip(accs, reader.weighted(p, start, stop), strict=True)
        ]
        if m:
            exact_sum, exact_acc = exact_sum * correction, exact_acc * correction
        running_max = new_max
        if several:
            # MLX would otherwise build every chunk's graph and may hold all their transients at
            # once; evaluating chunk by chunk keeps one chunk's keys alive (a sync point, so a
            # model wrapped in mx.compile cannot run multi-chunk attention)
            mx.eval(running_max, running_sum, *accs)
    acc = reader.latent_sum(accs)  # Σ p L_v over the coded tokens, [B, H, rows, r_v] (or a scalar 0)
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


class _LatentReader:
    """A chunk's scores and weighted values from the store's float32 latents (any coder)."""

    n_acc = 1

    def __init__(self, store: LatentStore, q: mx.array):
        self.store, self.q = store, q

    def scores(self, start: int, stop: int) -> mx.array:
        return self.q @ self.store.keys(start, stop).swapaxes(-1, -2)  # [B, H, rows, c]

    def weighted(self, p: mx.array, start: int, stop: int) -> list[mx.array]:
        return [p @ self.store.value_latents(start, stop)]

    def latent_sum(self, accs: list[mx.array]) -> mx.array:
        return accs[0]


def _per_head(per_group: mx.array, heads: int) -> mx.array:
    """``[G, ...]`` -> ``[H, ...]``: each head gets its group's array (heads are grouped contiguously)."""
    groups = per_group.shape[0]
    return per_group if groups == heads else mx.repeat(per_group, heads // groups, axis=0)


@dataclass(frozen=True)
class _Unpacking:
    """How to read one layout of packed rows: ``codes = floor(bytes @ gather) & mask``."""

    gather: mx.array  # [bytes, r] float32: 2^-shift on a channel's first byte, 2^(8-shift) on the next
    mask: mx.array  # [r] uint32, 2^w - 1
    offset: np.ndarray  # [r] float64, 0.5 - 2^w / 2: the latent is (code + offset) * step
    token_scale: bool
    scale_bits: int = 16


_UNPACKINGS: dict[tuple[tuple[int, ...], bool, int], _Unpacking] = {}


def _unpacking(rows: PackedRows) -> _Unpacking:
    key = (tuple(int(w) for w in rows.widths), bool(rows.token_scale), int(rows.scale_bits))
    found = _UNPACKINGS.get(key)
    if found is None:
        widths = np.array(key[0], dtype=np.int64)
        lead = scale_bytes(key[2]) if key[1] else 0
        start = np.concatenate([[0], np.cumsum(widths)[:-1]])
        n_bytes = lead + -(-int(widths.sum()) // 8)
        if rows.rows.shape[-1] != n_bytes:
            raise KVDataError(
                f"packed rows of {rows.rows.shape[-1]} bytes do not match widths {list(key[0])} "
                f"(token_scale={key[1]}, scale_bits={key[2]}): {n_bytes} bytes"
            )
        gather = np.zeros((n_bytes, len(widths)), dtype=np.float32)
        for c, (first, shift) in enumerate(zip(lead + start // 8, start % 8, strict=True)):
            # a code of at most 8 bits starting at bit `shift` of byte `first` lies in that byte and
            # the next: their value as a 16-bit number, shifted right, is exact in float32
            gather[first, c] = 2.0**-shift
            if first + 1 < n_bytes:
                gather[first + 1, c] = 2.0 ** (8 - shift)
        found = _Unpacking(
            gather=mx.array(gather),
            mask=mx.array((1 << widths) - 1, dtype=mx.uint32),
            offset=0.5 - (1 << widths) / 2.0,
            token_scale=key[1],
            scale_bits=key[2],
        )
        if len(_UNPACKINGS) >= _MAX_MEMO:
            _UNPACKINGS.clear()
        _UNPACKINGS[key] = found
    return found


def _unpack(rows: mx.array, unpacking: _Unpacking) -> tuple[mx.array, mx.array | None]:
    """Packed rows ``[B, H, c, bytes]`` -> integer codes ``[B, H, c, r]`` float32 and the rows'
    scales ``[B, H, c, 1]`` float32 (None without ``token_scale``)."""
    spread = rows.astype(mx.float32) @ unpacking.gather  # each channel's two bytes, shifted
    codes = (spread.astype(mx.uint32) & unpacking.mask).astype(mx.float32)  # the cast floors (>= 0)
    if not unpacking.token_scale:
        return codes, None
    return codes, read_scales(rows[..., : scale_bytes(unpacking.scale_bits)], unpacking.scale_bits)


class _RopeTables:
    """A RoPE written as two fixed tables and a per-chunk query matrix.

    With ``c_i, s_i`` the cosines and sines of the angles at token offset ``i`` inside a chunk that
    starts at position ``p``, and ``q'`` the query with its channel pairs swapped as RoPE's
    rotate-half swaps them (signed), angle addition gives
    ``q · R_(p+i) k = (k ∘ c_i) · (q ∘ c_p + q' ∘ s_p) + (k ∘ s_i) · (q' ∘ c_p - q ∘ s_p)``: the
    position-dependent part is the table ``[c_i, s_i]``, the same for every chunk and layer, and
    the chunk's start angle goes into the queries (:meth:`queries`).
    """

    def __init__(self, rotary: Rotary, d: int, n: int):
        half = rotary.dims // 2
        pairs = np.arange(half)
        self.first, self.second = (2 * pairs, 2 * pairs + 1) if rotary.traditional else (pairs, pairs + half)
        self.inv_freq = np.asarray(rotary.inv_freq, dtype=np.float64)
        self.d = d
        cos, sin = self._cos_sin(np.arange(n))
        #: ``[n, 2, D]`` float32: cos (1 on channels RoPE leaves alone) and sin (0 there) per offset
        self.table = mx.array(np.stack([cos, sin], axis=1).astype(np.float32))
        # rotate-half: out_a = x_a cos - x_b sin, out_b = x_b cos + x_a sin, so the sine terms
        # of q · R x are x_a q_b - x_b q_a: q' = q @ swap puts q_b at a and -q_a at b
        swap = np.zeros((d, d))
        swap[self.second, self.first] = 1.0
        swap[self.first, self.second] = -1.0
        self.swap = swap
        self._starts: dict[int, mx.array] = {}

    def _cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``[len, D]`` float64 cos and sin at ``positions`` (float64 angles: exact at any position)."""
        angle = positions[:, None] * self.inv_freq[None, :]
        cos, sin = np.ones((len(positions), self.d)), np.zeros((len(positions), self.d))
        cos[:, self.first], cos[:, self.second] = np.cos(angle), np.cos(angle)
        sin[:, self.first], sin[:, self.second] = np.sin(angle), np.sin(angle)
        return cos, sin

    def queries(self, position: int) -> mx.array:
        """``[D, 2D]`` float32: ``q @`` it is ``[q ∘ c_p + q' ∘ s_p, q' ∘ c_p - q ∘ s_p]`` for a chunk at ``position``."""
        found = self._starts.get(position)
        if found is None:
            cos, sin = (x[0] for x in self._cos_sin(np.array([position])))
            eye = np.eye(self.d)
            found = mx.array(
                np.concatenate([eye * cos + self.swap * sin, self.swap * cos - eye * sin], axis=1).astype(
                    np.float32
                )
            )
            if len(self._starts) >= _MAX_MEMO:
                self._starts.clear()
            self._starts[position] = found
        return found


_ROPE_TABLES: dict[tuple, _RopeTables] = {}


def _rope_tables(rotary: Rotary, d: int, n: int) -> _RopeTables:
    """The tables of ``rotary`` for ``n`` token offsets and head dim ``d``, made once per process and
    RoPE (``n x 2 x D`` float32, whatever the context length)."""
    key = (np.asarray(rotary.inv_freq, dtype=np.float32).tobytes(), rotary.dims, rotary.traditional, d, n)
    found = _ROPE_TABLES.get(key)
    if found is None:
        found = _RopeTables(rotary, d, n)
        if len(_ROPE_TABLES) >= _MAX_MEMO:
            _ROPE_TABLES.clear()
        _ROPE_TABLES[key] = found
    return found


class _PackedReader:
    """A chunk's scores and weighted values straight from :class:`PackedRows` (fixed quantizers).

    Keys: ``k_t = σ_t (c_t W + o) + μ`` with the codes ``c_t``, ``W = diag(step) Vᵀ`` and
    ``o = (offset ∘ step) Vᵀ`` per head, so the steps and offsets cost nothing per token. Values:
    ``Σ_t p_t L_t = (Σ_t p_t σ_t c_t + offset Σ_t p_t σ_t) ∘ step``, applied once after the last chunk.
    """

    n_acc = 2

    def __init__(self, store: LatentStore, q: mx.array, chunk: int):
        keys, values = store.packed_keys, store.packed_values
        h, d = store.heads, q.shape[-1]
        self.store, self.q = store, q
        self.keys, self.values = _unpacking(keys), _unpacking(values)
        kproj = store.key_projection
        synth = _per_head(kproj.synthesis.astype(mx.float32), h).swapaxes(-1, -2)  # [H, r, D]
        k_steps = keys.steps.astype(mx.float32)  # [H, r]
        self.w = k_steps[:, :, None] * synth
        self.o = (mx.array(self.keys.offset.astype(np.float32)) * k_steps)[:, None, :] @ synth  # [H, 1, D]
        self.mean = _per_head(kproj.mean.astype(mx.float32), h)[:, None, :]  # [H, 1, D]
        self.v_steps = values.steps.astype(mx.float32)[:, None, :]  # [H, 1, r_v]
        self.v_offset = mx.array(self.values.offset.astype(np.float32))
        self.rope = None
        if store.rotary is not None:
            # tables for as many offsets as a chunk reads, in powers of two (a few sizes per process)
            span = min(chunk, max(16, 1 << max(0, store.coded_stop - store.exact - 1).bit_length()))
            self.rope = _rope_tables(store.rotary, d, span)

    def scores(self, start: int, stop: int) -> mx.array:
        codes, sigma = _unpack(self.store.packed_keys.rows[..., start:stop, :], self.keys)
        sigma_t = None if sigma is None else sigma.swapaxes(-1, -2)  # [B, H, 1, c]
        if self.rope is None:
            # no rotation: the projection folds into the queries, q kᵀ = σ ((q Wᵀ) cᵀ + q·o) + q·μ
            coded = (self.q @ self.w.swapaxes(-1, -2)) @ codes.swapaxes(-1, -2)
            coded = coded + self.q @ self.o.swapaxes(-1, -2)
            coded = coded if sigma_t is None else coded * sigma_t
            return coded + self.q @ self.mean.swapaxes(-1, -2)
        n, rows = stop - start, self.q.shape[2]
        table = self.rope.table[:n]  # [c, 2, D]
        query = self.q @ self.rope.queries(start)  # [B, H, rows, 2D]
        keys = codes @ self.w  # [B, H, c, D]: c W, the key before o, σ and μ
        turned = (keys[..., None, :] * table).reshape(*keys.shape[:-1], 2 * keys.shape[-1])
        coded = query @ turned.swapaxes(-1, -2)
        # o and μ are the same for every token: their rotated dot products need only the table
        # (one small product for both) instead of two more passes over the keys
        both = mx.concatenate([mx.tile(self.o, 2), mx.tile(self.mean, 2)], axis=-2)  # [H, 2, 2D]
        fixed = (query[..., None, :, :] * both[:, :, None, :]).reshape(
            *query.shape[:2], 2 * rows, query.shape[-1]
        )
        fixed = fixed @ table.reshape(n, -1).T  # [B, H, 2 rows, c]: o's rows, then μ's
        coded = coded + fixed[..., :rows, :]
        return (coded if sigma_t is None else coded * sigma_t) + fixed[..., rows:, :]

    def weighted(self, p: mx.array, start: int, stop: int) -> list[mx.array]:
        codes, sigma = _unpack(self.store.packed_values.rows[..., start:stop, :], self.values)
        if sigma is not None:
            p = p * sigma.swapaxes(-1, -2)
        return [p @ codes, mx.sum(p, axis=-1, keepdims=True)]

    def latent_sum(self, accs: list[mx.array]) -> mx.array:
        return (accs[0] + accs[1] * self.v_offset) * self.v_steps


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
