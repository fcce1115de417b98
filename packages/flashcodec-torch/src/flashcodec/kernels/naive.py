"""Pure-torch split-K decode attention on block-coded rows: the reference for the Triton kernel.

The math (one new query token per sequence, every codec linear along the sequence axis):
block ``b`` of ``r`` tokens is ``K_b = A_k @ S_b`` with stored rows ``S_b [R, D]`` and synthesis
matrix ``A_k [r, R]``, so the scores of its tokens are ``q @ K_b^T = (q @ S_b^T) @ A_k^T`` and the
value side is ``prob_b @ V_b = (prob_b @ A_v) @ S_b``. The ``[S, D]`` reconstruction never exists.
A codec with a per-channel step (chan4: ``K_b = (A_k @ S_b) * c_b + z_b`` per channel) scales the query by
``c_b`` before its dot products and adds ``q . z_b``; on the value side it scales the block's
weighted rows by ``c_b`` and adds ``z_b`` times the block's probability mass.

Flash-decoding split: the archived blocks are cut into splits of ``blocks_per_split`` blocks, plus
one last split for the raw tail. Each split ``s`` yields, per query head, the running max ``m_s``,
the sum ``l_s = sum exp(score - m_s)`` and the unnormalized ``acc_s = sum exp(score - m_s) v``;
:func:`combine_partials` merges them with log-sum-exp. The Triton kernel writes exactly these
partials, so tests compare both the partials and the combined output.

Imports torch only: the kernels are leaves of the package and know nothing of codecs or caches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

import torch

__all__ = [
    "CodedRows",
    "EMPTY_MAX",
    "dense_rows",
    "decode_attention_partials",
    "combine_partials",
    "decode_attention_naive",
    "as_float",
    "decoded_chunk",
    "hide_sink",
    "in_rotated_domain",
    "online_softmax_update",
    "prefill_attention_naive",
    "sink_partial",
]

#: the running max of a split with no visible token: finite, so ``exp(EMPTY_MAX - m)`` is 0, not NaN
EMPTY_MAX = -1.0e30


class CodedRows(NamedTuple):
    """One stream (keys or values) as the kernels read it, without decoding anything.

    Attributes:
        segments: the stored rows of every archived block, split in one or two tensors
            ``[B, H, n, R_i, D]`` whose rows, in order, are the ``R = sum R_i`` rows of a block, as
            a codec's ``row_segments`` gives them (jpeg: ``(coeffs,)``; png:
            ``(anchors[..., None, :], deltas)``); int8, fp16, bf16, fp32
            or fp64; usually views into the archive buffers (no copy). ``uint8`` segments are
            packed int4 codes ``[B, H, n, R_i, D / 2]``: element ``2i`` of a row in the low nibble
            of byte ``i``, element ``2i + 1`` in the high nibble, each nibble the code plus 8.
        scales: ``[B, H, n, R]`` fp32 dequantization scales per (block, row), or None (float rows).
        synthesis: ``A [r, R]`` fp32 with ``block = A @ rows``.
        tail: raw tail tokens ``[B, H, t, D]`` (``t < r + raw_window``), after the archived blocks.
        offsets: ``[B, H, n, R]`` fp32 zero points added to every element of a row after its
            scale (row = ``codes * scale + offset``), or None (the default; jpeg-zp has them).
        channel_scales, channel_offsets: ``[B, H, n, D]`` fp32, both or neither (the default):
            a per-channel step after synthesis, token ``t`` of block ``b`` being
            ``(A @ rows)[t] * channel_scales[b] + channel_offsets[b]`` (chan4 has it).
        identity_synthesis: whether ``synthesis`` is the identity (the codec's
            ``synthesis_is_identity``; chan4), so the kernels skip its product.
        rotation: ``M [D, D]`` fp32 orthonormal, or None (the default): the archived rows hold every
            token ``x`` as ``x @ M`` (a rotation of the channels, the codec's ``channel_rotation``)
            and everything above describes those rotated tokens; the tail holds the tokens
            unrotated. Scores use ``q . x = (q @ M) . (x @ M)``, outputs ``sum p x = (sum p (x @ M)) @ M^T``.
            :func:`decoded_chunk` returns the tokens rotated back; :func:`dense_rows` the rows as stored.
        sink: ``[B, H, k, D]`` (the tail's dtype, unrotated like the tail), or None (the default):
            the first ``k`` tokens of the sequence as the stream keeps them apart, replacing
            archived block 0's first ``k`` tokens (the stream's sink). :func:`decoded_chunk` puts
            them in; decode attention hides those archived tokens and attends the sink's in a split
            of its own (:func:`sink_partial`), after the tail's.
    """

    segments: tuple[torch.Tensor, ...]
    scales: torch.Tensor | None
    synthesis: torch.Tensor
    tail: torch.Tensor
    offsets: torch.Tensor | None = None
    channel_scales: torch.Tensor | None = None
    channel_offsets: torch.Tensor | None = None
    identity_synthesis: bool = False
    rotation: torch.Tensor | None = None
    sink: torch.Tensor | None = None

    @property
    def sink_len(self) -> int:
        """Tokens the sink replaces (0 without one, or with no archived block)."""
        return 0 if self.sink is None or self.n_blocks == 0 else self.sink.shape[2]

    @property
    def n_blocks(self) -> int:
        return self.segments[0].shape[2]

    @property
    def block_size(self) -> int:
        return self.synthesis.shape[0]

    @property
    def seq_len(self) -> int:
        """Tokens covered: ``n_blocks * r + t``."""
        return self.n_blocks * self.block_size + self.tail.shape[2]


@lru_cache(maxsize=16)
def _nibble_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 2]``: byte -> (low code, high code), each nibble minus 8."""
    byte = torch.arange(256)
    return torch.stack([(byte & 15) - 8, (byte >> 4) - 8], dim=-1).to(dtype=dtype, device=device)


def as_float(segment: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A row segment (or a slice of one) in ``dtype``, int4 codes unpacked: ``[..., D]``."""
    if segment.dtype != torch.uint8:
        return segment.to(dtype)
    # one table lookup per byte (about 1.7x faster on CPU than masking, shifting and stacking)
    table = _nibble_table(dtype, segment.device)
    return torch.nn.functional.embedding(segment.int(), table).flatten(-2)


def dense_rows(rows: CodedRows, start: int, stop: int) -> torch.Tensor:
    """The dequantized rows of blocks ``start .. stop-1`` as fp32 ``[B, H, stop-start, R, D]`` (a copy).

    The kernels never build this; tests use it to check an addressing against ``stored_rows``.
    The per-channel step (``channel_scales``) comes after synthesis and is not applied here.
    """
    dense = torch.cat([as_float(seg[:, :, start:stop]) for seg in rows.segments], dim=3)
    if rows.scales is not None:
        dense = dense * rows.scales[:, :, start:stop, :, None]
    if rows.offsets is not None:
        dense = dense + rows.offsets[:, :, start:stop, :, None]
    return dense


def _flat_rows(segment: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Blocks ``start..stop-1`` of one segment as fp32 ``[B, H, nb * R_i, D]`` (int8 cast, int4 unpacked here)."""
    b, h, _, rows, _ = segment.shape
    flat = as_float(segment[:, :, start:stop])
    return flat.reshape(b, h, (stop - start) * rows, flat.shape[-1])


def _packed_halves(segment: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int4 blocks ``start..stop-1`` as fp32 codes ``(even, odd)``, each ``[B, H, nb * R_i, D / 2]``
    (elements ``0, 2, 4, ...`` and ``1, 3, 5, ...`` of every row)."""
    b, h, _, rows, w = segment.shape
    flat = segment[:, :, start:stop].reshape(b, h, (stop - start) * rows, w)
    return (flat & 15).float().sub_(8), (flat >> 4).float().sub_(8)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [..., M, K] @ b [..., K, N]`` over equal leading dims as one 3-D ``bmm`` (a broadcasting
    ``matmul`` on 5-D strided operands falls back to a copy per batch on the CPU)."""
    lead = a.shape[:-2]
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.reshape(*lead, *out.shape[-2:])


def _channel_dots(q: torch.Tensor, rows: CodedRows, start: int, stop: int) -> torch.Tensor:
    """:func:`_row_dots` for rows with a per-channel scale: ``q * scale_b`` is a query of its own
    for each block ``b``, so one batched matmul per segment over the blocks -> ``[B, Hkv, G, nb, R]``."""
    assert rows.channel_scales is not None
    qb = q[:, :, None] * rows.channel_scales[:, :, start:stop, None, :]  # [B, Hkv, nb, G, D]
    dots = []
    for seg in rows.segments:
        part = seg[:, :, start:stop]  # [B, Hkv, nb, R_i, D or D/2]
        if seg.dtype == torch.uint8:
            even, odd = (part & 15).float().sub_(8), (part >> 4).float().sub_(8)
            dot = _bmm(qb[..., 0::2].contiguous(), even.transpose(-1, -2))
            dot += _bmm(qb[..., 1::2].contiguous(), odd.transpose(-1, -2))
        else:
            dot = _bmm(qb, as_float(part).transpose(-1, -2))
        dots.append(dot)
    out = dots[0] if len(dots) == 1 else torch.cat(dots, dim=-1)
    return out.transpose(2, 3)


def _token_scores(q: torch.Tensor, rows: CodedRows, start: int, stop: int) -> torch.Tensor:
    """``q [B, Hkv, G, D]`` against the tokens of blocks ``start..stop-1`` -> ``[B, Hkv, G, nb, r]``:
    the row dot products through the synthesis matrix (skipped when it is the identity), plus
    ``q . offset_b`` for a per-channel step."""
    dots = _row_dots(q, rows, start, stop)
    if not rows.identity_synthesis:
        dots = dots @ rows.synthesis.float().T
    if rows.channel_offsets is not None:
        shift = torch.einsum("bhgd,bhnd->bhgn", q, rows.channel_offsets[:, :, start:stop])
        dots = dots + shift[..., None]
    return dots


def _row_dots(q: torch.Tensor, rows: CodedRows, start: int, stop: int) -> torch.Tensor:
    """``q [B, Hkv, G, D]`` against the stored rows of blocks ``start..stop-1`` -> ``[B, Hkv, G, nb, R]``.

    One matmul per segment on the rows as stored; the scales multiply the dot products, which
    are ``D`` times fewer than the rows. Rows with a per-channel scale go through :func:`_channel_dots`.
    """
    if rows.channel_scales is not None:
        out = _channel_dots(q, rows, start, stop)
        if rows.scales is not None:
            out = out * rows.scales[:, :, None, start:stop]
        if rows.offsets is not None:
            raise ValueError("CodedRows with both row offsets and a per-channel step are not supported")
        return out
    b, h, g, _ = q.shape
    nb = stop - start
    dots = []
    for seg in rows.segments:
        if seg.dtype == torch.uint8:
            # packed int4: q . row = q_even . row_even + q_odd . row_odd, two half-width matmuls on
            # the nibbles (no interleaved unpacked copy of the rows)
            even, odd = _packed_halves(seg, start, stop)
            dot = q[..., 0::2] @ even.transpose(-1, -2) + q[..., 1::2] @ odd.transpose(-1, -2)
        else:
            dot = q @ _flat_rows(seg, start, stop).transpose(-1, -2)
        dots.append(dot.reshape(b, h, g, nb, seg.shape[3]))
    out = dots[0] if len(dots) == 1 else torch.cat(dots, dim=-1)
    if rows.scales is not None:
        out = out * rows.scales[:, :, None, start:stop]
    if rows.offsets is not None:
        # q . (offset * ones) = offset * sum(q): the zero point costs one product per row
        out = out + rows.offsets[:, :, None, start:stop] * q.sum(-1)[..., None, None]
    return out


def _channel_weighted(
    weights: torch.Tensor, token_weights: torch.Tensor, rows: CodedRows, start: int, stop: int
) -> torch.Tensor:
    """:func:`_weighted_rows` for rows with a per-channel step: block by block (one batched matmul
    per segment), each block's sum scaled per channel, plus ``sum_b offset_b * sum(p in b)``
    (``token_weights [B, Hkv, G, nb]``: the probability mass of each block's tokens)."""
    assert rows.channel_scales is not None and rows.channel_offsets is not None
    if rows.scales is not None:
        weights = weights * rows.scales[:, :, None, start:stop]
    w = weights.transpose(2, 3).contiguous()  # [B, Hkv, nb, G, R]
    out, offset = None, 0
    for seg in rows.segments:
        count = seg.shape[3]
        part, codes = w[..., offset : offset + count], seg[:, :, start:stop]
        if seg.dtype == torch.uint8:
            even, odd = (codes & 15).float().sub_(8), (codes >> 4).float().sub_(8)
            term = torch.stack([_bmm(part, even), _bmm(part, odd)], dim=-1).flatten(-2)
        else:
            term = _bmm(part, as_float(codes))
        out = term if out is None else out + term
        offset += count
    assert out is not None
    scaled = torch.einsum("bhngd,bhnd->bhgd", out, rows.channel_scales[:, :, start:stop])
    return scaled + torch.einsum("bhgn,bhnd->bhgd", token_weights, rows.channel_offsets[:, :, start:stop])


def _weighted_rows(weights: torch.Tensor, rows: CodedRows, start: int, stop: int) -> torch.Tensor:
    """``sum_{n, j} weights[..., n, j] * rows[n, j]``: ``weights [B, Hkv, G, nb, R]`` -> ``[B, Hkv, G, D]``."""
    # zero points: every element of row j carries offset_j, so the output gains sum(w * offset)
    shift = None
    if rows.offsets is not None:
        shift = (weights * rows.offsets[:, :, None, start:stop]).sum(dim=(-1, -2))[..., None]
    if rows.scales is not None:
        weights = weights * rows.scales[:, :, None, start:stop]
    b, h, g, nb, _ = weights.shape
    out, offset = None, 0
    for seg in rows.segments:
        count = seg.shape[3]
        part = weights[..., offset : offset + count].reshape(b, h, g, nb * count)
        if seg.dtype == torch.uint8:  # packed int4: even and odd elements from the two nibbles
            even, odd = _packed_halves(seg, start, stop)
            term = torch.stack([part @ even, part @ odd], dim=-1).flatten(-2)
        else:
            term = part @ _flat_rows(seg, start, stop)
        out = term if out is None else out + term
        offset += count
    assert out is not None
    return out if shift is None else out + shift


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (Gemma 2's logit soft-capping), or ``scores`` for None."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def with_sinks(
    m: torch.Tensor, denom: torch.Tensor, acc: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode partials ``m, denom [B, Hq, P]``, ``acc [B, Hq, P, Dv]`` plus one split per head for an
    attention sink (gpt-oss): a logit ``sinks [Hq]`` in the softmax's denominator with no value."""
    if sinks is None:
        return m, denom, acc
    b, hq = m.shape[:2]
    m_sink = sinks.float().to(m.device).reshape(1, hq, 1).expand(b, hq, 1)
    return (
        torch.cat([m, m_sink], dim=-1),
        torch.cat([denom, torch.ones_like(m_sink)], dim=-1),
        torch.cat([acc, acc.new_zeros(b, hq, 1, acc.shape[-1])], dim=-2),
    )


def _softmax_partial(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``scores [..., T]`` -> ``(m [...], l [...], p [..., T])`` with masked (-inf) entries giving 0."""
    if scores.shape[-1] == 0:  # an empty tail: amax has nothing to reduce
        m = scores.new_full(scores.shape[:-1], EMPTY_MAX)
        return m, torch.zeros_like(m), scores
    m = scores.amax(dim=-1).clamp_min(EMPTY_MAX)
    p = torch.exp(scores - m.unsqueeze(-1))
    return m, p.sum(dim=-1), p


def decode_attention_partials(
    query: torch.Tensor,
    keys: CodedRows,
    values: CodedRows,
    *,
    scale: float,
    key_mask: torch.Tensor | None = None,
    blocks_per_split: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-split softmax partials of one decode query over coded keys and values.

    Args:
        query: ``[B, Hq, D]`` (any float dtype; computed in fp32), ``Hq = G * Hkv`` with query head
            ``h * G + g`` reading key/value head ``h`` (transformers' ``repeat_kv`` order).
        keys, values: the two streams, ``Hkv`` heads each, the same block size and length.
        scale: multiplies every score (usually ``D ** -0.5``).
        key_mask: optional additive fp32 ``[B, S]`` (0 = visible, -inf = hidden).
        blocks_per_split: archived blocks per split (default: all in one split).
        softcap: None, or the logit soft-cap every score passes through (:func:`capped`).

    Returns:
        ``(m, denom, acc)``: fp32 ``[B, Hq, n_splits + 1]``, ``[B, Hq, n_splits + 1]`` and
        ``[B, Hq, n_splits + 1, Dv]``; split ``n_splits`` (the last) is the raw tail. A split that
        sees no token has ``m = EMPTY_MAX``, ``denom = 0``, ``acc = 0``. With a sink
        (:attr:`CodedRows.sink` on either side) there is one more split, after the tail's: the
        sink's tokens (:func:`sink_partial`), hidden in the archived splits.
    """
    b, hq, d = query.shape
    hkv = keys.segments[0].shape[1]
    g = hq // hkv
    r, n = keys.block_size, keys.n_blocks
    sink_mask, key_mask = key_mask, hide_sink(keys, values, key_mask, b, query.device)
    q = (query.float() * scale).reshape(b, hkv, g, d)
    # rotated archives (CodedRows.rotation): the archived keys meet the query rotated alike, and
    # each archived split's output is rotated back before it meets the (unrotated) tail's
    q_arch = q if keys.rotation is None else q @ keys.rotation.float()
    v_back = None if values.rotation is None else values.rotation.float().T
    step = max(1, n if blocks_per_split is None else int(blocks_per_split))
    a_v = values.synthesis.float()
    ms, ls, accs = [], [], []
    for start in range(0, n, step):
        stop = min(start + step, n)
        nb = stop - start
        # q . S^T per stored row, then the synthesis matrix turns rows into token scores
        scores = capped(_token_scores(q_arch, keys, start, stop).reshape(b, hkv, g, nb * r), softcap)
        if key_mask is not None:
            scores = scores + key_mask[:, None, None, start * r : stop * r]
        m, denom, p = _softmax_partial(scores)
        # prob @ V_block = (prob @ A_v) @ S_v: weights per stored value row
        probs = p.reshape(b, hkv, g, nb, r)
        row_weights = probs if values.identity_synthesis else probs @ a_v  # [B, Hkv, G, nb, Rv]
        if values.channel_scales is not None:
            acc = _channel_weighted(row_weights, probs.sum(-1), values, start, stop)
        else:
            acc = _weighted_rows(row_weights, values, start, stop)
        if v_back is not None:
            acc = acc @ v_back
        ms.append(m), ls.append(denom), accs.append(acc)
    # the raw tail: ordinary attention over fewer than r + raw_window tokens
    tail_k, tail_v = keys.tail.float(), values.tail.float()
    scores = capped(torch.einsum("bhgd,bhtd->bhgt", q, tail_k), softcap)
    if key_mask is not None:
        scores = scores + key_mask[:, None, None, n * r : n * r + tail_k.shape[2]]
    m, denom, p = _softmax_partial(scores)
    ms.append(m), ls.append(denom), accs.append(torch.einsum("bhgt,bhtd->bhgd", p, tail_v))
    dv = values.tail.shape[-1]
    sink = sink_partial(query, keys, values, scale=scale, key_mask=sink_mask, softcap=softcap)
    if sink is not None:
        ms.append(sink[0].reshape(b, hkv, g)), ls.append(sink[1].reshape(b, hkv, g))
        accs.append(sink[2].reshape(b, hkv, g, dv))
    return (
        torch.stack(ms, dim=-1).reshape(b, hq, -1),
        torch.stack(ls, dim=-1).reshape(b, hq, -1),
        torch.stack(accs, dim=-2).reshape(b, hq, -1, dv),
    )


def _sink_len(keys: CodedRows, values: CodedRows) -> int:
    return max(keys.sink_len, values.sink_len)


def _first_tokens(rows: CodedRows, k: int) -> torch.Tensor:
    """The first ``k`` tokens of a stream in fp32: its sink when that holds them all, else archived
    block 0 decoded (not rounded to the stream dtype: as the archived splits read it)."""
    if rows.sink_len >= k:
        assert rows.sink is not None
        return rows.sink[:, :, :k].float()
    return decoded_chunk(rows, 0, 1, torch.float32)[:, :, :k]


def hide_sink(
    keys: CodedRows, values: CodedRows, key_mask: torch.Tensor | None, batch: int, device: torch.device
) -> torch.Tensor | None:
    """``key_mask`` (additive fp32 ``[B, S]``, or None) with the archived tokens a sink replaces
    hidden (``-inf``): what the archived splits of a decode step read. Unchanged without a sink."""
    k = _sink_len(keys, values)
    if not k:
        return key_mask
    mask = key_mask if key_mask is not None else torch.zeros(batch, keys.seq_len, device=device)
    mask = mask.clone()
    mask[:, :k] = -math.inf
    return mask


def sink_partial(
    query: torch.Tensor,
    keys: CodedRows,
    values: CodedRows,
    *,
    scale: float,
    key_mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The decode split of a sink: ``(m [B, Hq], denom [B, Hq], acc [B, Hq, Dv])`` over the first
    ``k`` tokens, each side taken from its sink or, without one, from archived block 0 decoded
    (:func:`decoded_chunk`); None without a sink. ``query [B, Hq, D]`` unscaled, in the basis of
    the tails (both kernels call this same function, so their partials agree by construction);
    ``key_mask`` the caller's additive ``[B, S]`` (None: all visible)."""
    k = _sink_len(keys, values)
    if not k:
        return None
    b, hq, d = query.shape
    hkv = keys.tail.shape[1]
    g = hq // hkv
    sink_k, sink_v = _first_tokens(keys, k), _first_tokens(values, k)  # [B, Hkv, k, D], [B, Hkv, k, Dv]
    q = (query.float() * scale).reshape(b, hkv, g, d)
    scores = capped(torch.einsum("bhgd,bhtd->bhgt", q, sink_k), softcap)
    if key_mask is not None:
        scores = scores + key_mask[:, None, None, :k]
    m, denom, p = _softmax_partial(scores)
    acc = torch.einsum("bhgt,bhtd->bhgd", p, sink_v)
    return m.reshape(b, hq), denom.reshape(b, hq), acc.reshape(b, hq, -1)


def in_rotated_domain(
    query: torch.Tensor, keys: CodedRows, values: CodedRows
) -> tuple[torch.Tensor, CodedRows, CodedRows, Callable[[torch.Tensor], torch.Tensor]]:
    """The same decode attention with every token, the tail's too, in the rotated basis.

    For a kernel that knows nothing of :attr:`CodedRows.rotation` (the Triton kernel): returns
    ``(query', keys', values', back)`` with ``query' = query @ M_k`` and each tail rotated, both
    fp32, and ``rotation=None``; ``back(out')`` (``[B, Hq, Dv]``) is the output in ``query.dtype``
    (``out' @ M_v^T``). Streams without a rotation pass through unchanged; ``query [B, Hq, D]``.
    """
    mk, mv, dtype = keys.rotation, values.rotation, query.dtype

    def turned(t: torch.Tensor | None, m: torch.Tensor) -> torch.Tensor | None:
        return None if t is None else t.float() @ m.float()

    # a sink is held unrotated like the tail, so it turns with it
    if mk is not None:
        query = query.float() @ mk.float()
        keys = keys._replace(tail=turned(keys.tail, mk), sink=turned(keys.sink, mk), rotation=None)
    if mv is not None:
        values = values._replace(tail=turned(values.tail, mv), sink=turned(values.sink, mv), rotation=None)

    def back(out: torch.Tensor) -> torch.Tensor:
        return (out if mv is None else out.float() @ mv.float().T).to(dtype)

    return query, keys, values, back


def combine_partials(
    m: torch.Tensor, denom: torch.Tensor, acc: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Log-sum-exp merge of split partials: ``m, denom [B, Hq, P]``, ``acc [B, Hq, P, Dv]`` -> ``[B, Hq, Dv]``."""
    top = m.amax(dim=-1, keepdim=True)
    w = torch.exp(m - top)
    total = (w * denom).sum(dim=-1, keepdim=True)
    return ((w.unsqueeze(-1) * acc).sum(dim=-2) / total).to(dtype)


def decode_attention_naive(
    query: torch.Tensor,
    keys: CodedRows,
    values: CodedRows,
    *,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    blocks_per_split: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention on coded rows: ``query [B, Hq, D]`` -> ``[B, Hq, Dv]`` in ``query.dtype``.

    ``scale`` defaults to ``D ** -0.5``; ``sinks``: None or one attention-sink logit per query head
    ``[Hq]`` (:func:`with_sinks`); the other arguments as :func:`decode_attention_partials`.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    m, denom, acc = decode_attention_partials(
        query,
        keys,
        values,
        scale=scale,
        key_mask=key_mask,
        blocks_per_split=blocks_per_split,
        softcap=softcap,
    )
    return combine_partials(*with_sinks(m, denom, acc, sinks), query.dtype)


# --------------------------------------------------------------------------- multi-token steps
def decoded_chunk(rows: CodedRows, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Blocks ``start .. stop-1`` decoded: ``[B, H, (stop-start) * r, D]`` in the tail's dtype.

    ``A @ rows`` on the stored rows of those blocks only (rotated back by ``rotation^T`` when set). The arithmetic runs in fp64 when a
    segment is fp64 (png deltas: every partial sum is exact there, so the tokens come back bit
    for bit) and in fp32 otherwise; the result is rounded to the stream dtype (``tail.dtype``),
    exactly like the codec's own decode, so a chunk equals the same slice of the materialized view
    (``dtype``: another dtype instead). Block 0's first tokens come from :attr:`CodedRows.sink`
    where there is one.
    """
    wide = any(seg.dtype == torch.float64 for seg in rows.segments)
    cdt = torch.float64 if wide else torch.float32
    parts = [as_float(seg[:, :, start:stop], cdt) for seg in rows.segments]
    dense = parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
    if rows.scales is not None:
        # out of place: an fp32 / fp64 segment's .to() is a view of the archive itself
        dense = dense * rows.scales[:, :, start:stop, :, None].to(cdt)
    if rows.offsets is not None:
        dense = dense + rows.offsets[:, :, start:stop, :, None].to(cdt)
    blocks = torch.matmul(rows.synthesis.to(cdt), dense)  # [B, H, nb, r, D]
    if rows.channel_scales is not None and rows.channel_offsets is not None:
        scale, shift = (
            t[:, :, start:stop, None, :].to(cdt) for t in (rows.channel_scales, rows.channel_offsets)
        )
        blocks = blocks * scale + shift
    if rows.rotation is not None:  # the tokens in their own channels, like the codec's decode
        blocks = blocks @ rows.rotation.to(cdt).T
    b, h, nb, r, d = blocks.shape
    out = blocks.reshape(b, h, nb * r, d).to(rows.tail.dtype if dtype is None else dtype)
    k = rows.sink_len
    if start == 0 and k and stop > start:  # block 0's first tokens as the sink holds them
        assert rows.sink is not None
        out[:, :, :k] = rows.sink.to(out.dtype)
    return out


def online_softmax_update(
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scores: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One log-sum-exp step: fold ``scores [..., T]`` over ``values [..., T, Dv]`` into ``(m, l, acc)``.

    ``m [...]`` running max (:data:`EMPTY_MAX` before any visible score), ``l [...]`` running sum of
    ``exp(score - m)``, ``acc [..., Dv]`` running unnormalized output; all fp32.
    """
    m, denom, acc = state
    if scores.shape[-1] == 0:
        return state
    m_new = torch.maximum(m, scores.amax(dim=-1).clamp_min(EMPTY_MAX))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new.unsqueeze(-1))
    return m_new, denom * alpha + p.sum(dim=-1), acc * alpha.unsqueeze(-1) + p @ values


def prefill_attention_naive(
    query: torch.Tensor,
    keys: CodedRows,
    values: CodedRows,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    chunk_blocks: int = 64,
    score_elements: int = 1 << 18,
    tail_tokens: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``s`` new query tokens over coded keys/values, chunk by chunk (never the whole view).

    Args:
        query: ``[B, Hq, s, D]``, the queries of the last ``s`` tokens the streams hold (already
            appended); ``Hq = G * Hkv`` (query head ``h * G + g`` reads kv head ``h``).
        keys, values: the two streams' rows (:class:`CodedRows`), ``S`` tokens each.
        scale: multiplies every score (default ``D ** -0.5``).
        mask: None (causal: query ``i`` sees keys ``0 .. S - s + i``) or additive fp32
            ``[B, 1 | Hq, s, S]`` (0 visible, -inf hidden) replacing the causal rule.
        chunk_blocks: archived blocks decoded at a time (each is decoded once); the raw tail is
            the last chunk.
        score_elements: most score entries one pass forms (the queries are split to fit).
        tail_tokens: None (the raw tail is one chunk) or the tail's chunk length: a tail that holds
            a whole prompt's step is cut so that causal chunks skip the keys after each query.
        softcap, sinks: as :func:`decode_attention_naive`.

    Returns:
        ``[B, Hq, s, Dv]`` in ``query.dtype``, fp32 arithmetic on keys/values rounded to the
        stream dtype (as the materialized view holds them). A query that sees no key gets zeros.
        Peak temporaries: one decoded chunk of keys and values plus one pass's scores; the
        running state is the size of the output.
    """
    b, hq, s, d = query.shape
    hkv = keys.tail.shape[1]
    g = hq // hkv
    r, n = keys.block_size, keys.n_blocks
    total = keys.seq_len
    first = total - s  # position of query 0
    dv = values.tail.shape[-1]
    dev = query.device
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    cb = max(1, int(chunk_blocks))
    q = (query.float() * scale).reshape(b, hkv, g, s, d)
    m = torch.full((b, hkv, g, s), EMPTY_MAX, dtype=torch.float32, device=dev)
    denom = torch.zeros_like(m)
    acc = torch.zeros(b, hkv, g, s, dv, dtype=torch.float32, device=dev)
    chunks = [(start * r, min(start + cb, n) * r, start, min(start + cb, n)) for start in range(0, n, cb)]
    tail = max(1, total - n * r if tail_tokens is None else int(tail_tokens))
    chunks += [(k0, min(k0 + tail, total), None, None) for k0 in range(n * r, total, tail)]  # the raw tail
    pos_q = torch.arange(first, total, device=dev)
    for k0, k1, start, stop in chunks:
        if k1 <= k0 or (mask is None and k0 > total - 1):
            continue
        if start is None:
            kc, vc = keys.tail[:, :, k0 - n * r : k1 - n * r], values.tail[:, :, k0 - n * r : k1 - n * r]
        else:
            kc, vc = decoded_chunk(keys, start, stop), decoded_chunk(values, start, stop)
        kt = kc.float().unsqueeze(2).transpose(-1, -2)  # [B, Hkv, 1, D, T]
        vf = vc.float().unsqueeze(2)  # [B, Hkv, 1, T, Dv]
        qc = max(1, int(score_elements) // max(1, b * hq * (k1 - k0)))
        # causal: queries before position k0 see nothing of this chunk
        q_start = max(0, k0 - first) if mask is None else 0
        for q0 in range(q_start, s, qc):
            q1 = min(s, q0 + qc)
            scores = capped(q[:, :, :, q0:q1] @ kt, softcap)  # [B, Hkv, G, sq, T]
            if mask is None:
                pos_k = torch.arange(k0, k1, device=dev)
                scores = scores.masked_fill(pos_k[None, :] > pos_q[q0:q1, None], -math.inf)
            else:
                part = mask[:, :, q0:q1, k0:k1]
                part = part.reshape(b, hkv, g, q1 - q0, k1 - k0) if part.shape[1] == hq else part[:, :, None]
                scores = scores + part
            state = (m[..., q0:q1], denom[..., q0:q1], acc[..., q0:q1, :])
            m[..., q0:q1], denom[..., q0:q1], acc[..., q0:q1, :] = online_softmax_update(state, scores, vf)
    if sinks is not None:  # one more logit per head in each denominator, with no value
        sink = sinks.float().to(dev).reshape(1, hkv, g, 1)
        m_new = torch.maximum(m, sink)
        alpha = torch.exp(m - m_new)
        denom = denom * alpha + torch.exp(sink - m_new)
        acc = acc * alpha.unsqueeze(-1)
    out = acc / denom.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return out.reshape(b, hq, s, dv).to(query.dtype)
