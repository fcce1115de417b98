"""Triton split-K decode attention on block-coded rows (flash-decoding style).

Two kernels:

* ``_codec_partial_kernel``, grid ``(B * Hkv, n_splits + 1)``: program ``(b*Hkv + h, s)`` walks the
  archived blocks of split ``s`` in tiles of ``TILE`` blocks, reading the stored rows as they are
  (int8 coefficients and their fp32 scales, packed int4 with scales and optional zero points,
  or float coefficients, or png anchors + deltas),
  forms the token scores ``(q . S^T) @ A_k^T`` for the ``G`` query heads of kv head ``h``, runs an
  online softmax and accumulates ``((p @ A_v) * scales_v) @ S_v``; it writes the partial max,
  sum and accumulator. Rows with a per-channel step (chan4: ``token = row * c_n + z_n``) scale
  each loaded row by ``c_n`` and add ``q . z_n`` to the scores and ``z_n * sum(p)`` to the
  output. The last split (``s = n_splits``) covers the raw tail tokens.
* ``_combine_kernel``, grid ``(B * Hq,)``: merges the partials with log-sum-exp and writes the
  output in the query dtype.

Neither kernel ever forms a ``[S, D]`` tensor; all arithmetic is fp32. Packed int4 rows (``uint8``
segments, two codes a byte along ``D``) are unpacked in registers: element ``d`` is the nibble
``(byte[d // 2] >> 4 * (d % 2)) & 15``, minus 8. The contraction over the
``R`` stored rows and the ``r`` synthesis rows is unrolled (``R, r <= 64``), and every product is a
broadcast multiply + reduction (no ``tl.dot``), so tiny shapes work on any GPU and in the interpreter.

The reference is :func:`flashcodec.kernels.naive.decode_attention_partials` (same partials,
same split boundaries). On CUDA tensors the kernels are compiled. CPU tensors need the Triton
interpreter, which triton only offers when ``TRITON_INTERPRET=1`` is set before triton is first
imported in the process (transformers and ``torch._dynamo`` import it early); otherwise a CPU
call raises ``RuntimeError`` saying so (:func:`interpreter_active` tells in advance).

This module imports triton at import time: import it lazily.
"""

import math

import torch
import triton
import triton.language as tl

from .naive import EMPTY_MAX, CodedRows, hide_sink, sink_partial

__all__ = [
    "DEFAULT_TILE",
    "combine_partials_triton",
    "decode_attention_partials_triton",
    "default_blocks_per_split",
    "interpreter_active",
    "triton_decode_attention",
]

#: archived blocks a program handles per loop iteration
DEFAULT_TILE = 16
#: EMPTY_MAX as a constant the kernels can read
_EMPTY = tl.constexpr(EMPTY_MAX)


@triton.jit
def _codec_partial_kernel(
    Q, sqb, sqh, sqd,
    K0, sk0b, sk0h, sk0n, sk0j, sk0d,
    K1, sk1b, sk1h, sk1n, sk1j, sk1d,
    KS, sksb, sksh, sksn, sksj,
    KO, skob, skoh, skon, skoj,
    KC, skcb, skch, skcn, skcd,
    KZ, skzb, skzh, skzn, skzd,
    AK,
    V0, sv0b, sv0h, sv0n, sv0j, sv0d,
    V1, sv1b, sv1h, sv1n, sv1j, sv1d,
    VS, svsb, svsh, svsn, svsj,
    VO, svob, svoh, svon, svoj,
    VC, svcb, svch, svcn, svcd,
    VZ, svzb, svzh, svzn, svzd,
    AV,
    KT, sktb, skth, sktt, sktd,
    VT, svtb, svth, svtt, svtd,
    MASK, smb, sms,
    M_OUT, L_OUT, ACC_OUT, smob, smoh, smos, saob, saoh, saos, saod,
    n_blocks, tail_len, n_splits, blocks_per_split, hkv, groups, dim, dim_v, scale,
    R: tl.constexpr, RK: tl.constexpr, RK0: tl.constexpr, RV: tl.constexpr, RV0: tl.constexpr,
    RP: tl.constexpr, TP: tl.constexpr,
    GP: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, TILE: tl.constexpr,
    HAS_KS: tl.constexpr, HAS_VS: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_KO: tl.constexpr, HAS_VO: tl.constexpr, HAS_KC: tl.constexpr, HAS_VC: tl.constexpr,
    PACKED_K0: tl.constexpr, PACKED_K1: tl.constexpr, PACKED_V0: tl.constexpr, PACKED_V1: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // hkv
    h = pid % hkv
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    dv = tl.arange(0, DVP)
    p = tl.arange(0, RP)  # token row inside a block (r padded to a power of two)
    # packed int4 rows: element d sits in byte d // 2, low nibble for even d, high for odd
    dk0 = d // 2 if PACKED_K0 else d
    dk1 = d // 2 if PACKED_K1 else d
    dv0 = dv // 2 if PACKED_V0 else dv
    dv1 = dv // 2 if PACKED_V1 else dv
    g_ok = g < groups
    d_ok = d < dim
    dv_ok = dv < dim_v
    q = tl.load(
        Q + b * sqb + (h * groups + g)[:, None] * sqh + d[None, :] * sqd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q * scale  # [GP, DP]
    q_sum = tl.sum(q, axis=1)  # [GP]: a zero point z adds z * sum(q) to a row's dot product

    m_i = tl.full([GP], _EMPTY, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DVP], tl.float32)

    if split < n_splits:
        start = split * blocks_per_split
        stop = tl.minimum(start + blocks_per_split, n_blocks)
        for n0 in range(start, stop, TILE):
            n = n0 + tl.arange(0, TILE)
            n_ok = n < stop
            # scores[g, n, p] = sum_j (q[g] . S_k[n, j]) * A_k[p, j]
            scores = tl.zeros([GP, TILE, RP], tl.float32)
            if HAS_KC:  # per-channel step: q . (c * s_n + z_n) = (q * s_n) . c + q . z_n
                kc_ok = n_ok[:, None] & d_ok[None, :]
                kc = tl.load(
                    KC + b * skcb + h * skch + n[:, None] * skcn + d[None, :] * skcd, mask=kc_ok, other=0.0
                )
                kz = tl.load(
                    KZ + b * skzb + h * skzh + n[:, None] * skzn + d[None, :] * skzd, mask=kc_ok, other=0.0
                )
                scores += tl.sum(q[:, None, :] * kz[None, :, :], axis=2)[:, :, None]
            for j in tl.static_range(RK):
                if j < RK0:  # a compile-time choice of segment
                    ptr = K0 + b * sk0b + h * sk0h + n[:, None] * sk0n + j * sk0j + dk0[None, :] * sk0d
                    packed = PACKED_K0
                else:
                    ptr = (
                        K1 + b * sk1b + h * sk1h + n[:, None] * sk1n + (j - RK0) * sk1j + dk1[None, :] * sk1d
                    )
                    packed = PACKED_K1
                row_ok = n_ok[:, None] & d_ok[None, :]
                if packed:
                    byte = tl.load(ptr, mask=row_ok, other=0).to(tl.int32)
                    code = ((byte >> ((d % 2) * 4)[None, :]) & 15) - 8
                    row = tl.where(row_ok, code.to(tl.float32), 0.0)  # [TILE, DP]
                else:
                    row = tl.load(ptr, mask=row_ok, other=0).to(tl.float32)  # [TILE, DP]
                if HAS_KC:
                    row = row * kc
                qs = tl.sum(q[:, None, :] * row[None, :, :], axis=2)  # [GP, TILE]
                if HAS_KS:
                    ks = tl.load(KS + b * sksb + h * sksh + n * sksn + j * sksj, mask=n_ok, other=0.0)
                    qs = qs * ks[None, :]
                if HAS_KO:
                    ko = tl.load(KO + b * skob + h * skoh + n * skon + j * skoj, mask=n_ok, other=0.0)
                    qs += q_sum[:, None] * ko[None, :]
                a_col = tl.load(AK + p * RK + j, mask=p < R, other=0.0)  # [RP]
                scores += qs[:, :, None] * a_col[None, None, :]
            visible = n_ok[:, None] & (p[None, :] < R)  # [TILE, RP]
            if HAS_MASK:
                pos = n[:, None] * R + p[None, :]
                scores += tl.load(MASK + b * smb + pos * sms, mask=visible, other=0.0)[None, :, :]
            scores = tl.where(visible[None, :, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(tl.max(scores, axis=2), axis=1))
            alpha = tl.exp(m_i - m_new)
            probs = tl.exp(scores - m_new[:, None, None])  # [GP, TILE, RP]
            l_i = l_i * alpha + tl.sum(tl.sum(probs, axis=2), axis=1)
            acc = acc * alpha[:, None]
            if HAS_VC:  # per-channel step on the value side: scale each block's codes, add z_n * sum(p)
                vc_ok = n_ok[:, None] & dv_ok[None, :]
                vc = tl.load(
                    VC + b * svcb + h * svch + n[:, None] * svcn + dv[None, :] * svcd, mask=vc_ok, other=0.0
                )
                vz = tl.load(
                    VZ + b * svzb + h * svzh + n[:, None] * svzn + dv[None, :] * svzd, mask=vc_ok, other=0.0
                )
                acc += tl.sum(tl.sum(probs, axis=2)[:, :, None] * vz[None, :, :], axis=1)
            # acc[g] += sum_n sum_j (sum_p probs[g, n, p] * A_v[p, j]) * S_v[n, j]
            for j in tl.static_range(RV):
                a_col = tl.load(AV + p * RV + j, mask=p < R, other=0.0)  # [RP]
                w = tl.sum(probs * a_col[None, None, :], axis=2)  # [GP, TILE]
                if HAS_VO:  # every element of the row carries its zero point: one shift per row
                    vo = tl.load(VO + b * svob + h * svoh + n * svon + j * svoj, mask=n_ok, other=0.0)
                    acc += tl.sum(w * vo[None, :], axis=1)[:, None]
                if HAS_VS:
                    vs = tl.load(VS + b * svsb + h * svsh + n * svsn + j * svsj, mask=n_ok, other=0.0)
                    w = w * vs[None, :]
                if j < RV0:
                    ptr = V0 + b * sv0b + h * sv0h + n[:, None] * sv0n + j * sv0j + dv0[None, :] * sv0d
                    packed = PACKED_V0
                else:
                    ptr = (
                        V1 + b * sv1b + h * sv1h + n[:, None] * sv1n + (j - RV0) * sv1j + dv1[None, :] * sv1d
                    )
                    packed = PACKED_V1
                row_ok = n_ok[:, None] & dv_ok[None, :]
                if packed:
                    byte = tl.load(ptr, mask=row_ok, other=0).to(tl.int32)
                    code = ((byte >> ((dv % 2) * 4)[None, :]) & 15) - 8
                    row = tl.where(row_ok, code.to(tl.float32), 0.0)  # [TILE, DVP]
                else:
                    row = tl.load(ptr, mask=row_ok, other=0).to(tl.float32)  # [TILE, DVP]
                if HAS_VC:
                    row = row * vc
                acc += tl.sum(w[:, :, None] * row[None, :, :], axis=1)
            m_i = m_new
    else:
        # the raw tail (fewer than r + the codec's raw_window tokens): plain attention
        tp = tl.arange(0, TP)
        t_ok = tp < tail_len
        kt = tl.load(
            KT + b * sktb + h * skth + tp[:, None] * sktt + d[None, :] * sktd,
            mask=t_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        scores = tl.sum(q[:, None, :] * kt[None, :, :], axis=2)  # [GP, TP]
        if HAS_MASK:
            pos = n_blocks * R + tp
            scores += tl.load(MASK + b * smb + pos * sms, mask=t_ok, other=0.0)[None, :]
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_i = tl.maximum(m_i, tl.max(scores, axis=1))
        probs = tl.exp(scores - m_i[:, None])
        l_i = tl.sum(probs, axis=1)
        vt = tl.load(
            VT + b * svtb + h * svth + tp[:, None] * svtt + dv[None, :] * svtd,
            mask=t_ok[:, None] & dv_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc = tl.sum(probs[:, :, None] * vt[None, :, :], axis=1)

    head = h * groups + g
    tl.store(M_OUT + b * smob + head * smoh + split * smos, m_i, mask=g_ok)
    tl.store(L_OUT + b * smob + head * smoh + split * smos, l_i, mask=g_ok)
    tl.store(
        ACC_OUT + b * saob + head[:, None] * saoh + split * saos + dv[None, :] * saod,
        acc,
        mask=g_ok[:, None] & dv_ok[None, :],
    )


@triton.jit
def _combine_kernel(
    M, L, ACC, smb, smh, sms, sab, sah, sas, sad,
    OUT, sob, soh, sod,
    hq, n_parts, dim_v,
    SP: tl.constexpr, DVP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // hq
    h = pid % hq
    s = tl.arange(0, SP)
    dv = tl.arange(0, DVP)
    s_ok = s < n_parts
    dv_ok = dv < dim_v
    m = tl.load(M + b * smb + h * smh + s * sms, mask=s_ok, other=_EMPTY)
    denom = tl.load(L + b * smb + h * smh + s * sms, mask=s_ok, other=0.0)
    acc = tl.load(
        ACC + b * sab + h * sah + s[:, None] * sas + dv[None, :] * sad,
        mask=s_ok[:, None] & dv_ok[None, :],
        other=0.0,
    )
    top = tl.max(m, axis=0)
    w = tl.exp(m - top)
    total = tl.sum(w * denom, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / total
    tl.store(OUT + b * sob + h * soh + dv * sod, out.to(OUT.dtype.element_ty), mask=dv_ok)


def interpreter_active() -> bool:
    """Whether triton runs kernels in its CPU interpreter in this process.

    True only when ``TRITON_INTERPRET=1`` was set before triton was first imported: triton's own
    library functions are built in one mode at that import.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction) and isinstance(_combine_kernel, InterpretedFunction)


def _check_device(t: torch.Tensor) -> None:
    if not t.is_cuda and not interpreter_active():
        raise RuntimeError(
            f"the Triton kernels need CUDA tensors (got a tensor on {t.device}); to run them on the CPU, "
            "set TRITON_INTERPRET=1 before triton is first imported in the process"
        )


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _scale_args(rows: CodedRows) -> tuple:
    """Pointer + strides of the ``[B, H, n, R]`` scales (a dummy pointer when there are none)."""
    if rows.scales is None:
        return (rows.synthesis, 0, 0, 0, 0)
    s = rows.scales
    return (s, *s.stride())


def _offset_args(rows: CodedRows) -> tuple:
    """Pointer + strides of the ``[B, H, n, R]`` zero points (a dummy pointer when there are none)."""
    if rows.offsets is None:
        return (rows.synthesis, 0, 0, 0, 0)
    o = rows.offsets
    return (o, *o.stride())


def _channel_args(rows: CodedRows) -> tuple:
    """Pointers + strides of the ``[B, H, n, D]`` per-channel scales and offsets (dummies when none)."""
    if rows.channel_scales is None or rows.channel_offsets is None:
        return (rows.synthesis, 0, 0, 0, 0) * 2
    c, z = rows.channel_scales, rows.channel_offsets
    return (c, *c.stride(), z, *z.stride())


def _segment_args(rows: CodedRows) -> tuple:
    """Pointers + strides of the (one or two) row segments; a lone segment is passed twice."""
    if len(rows.segments) > 2:
        raise ValueError(f"the Triton kernel reads at most two row segments; got {len(rows.segments)}")
    first = rows.segments[0]
    second = rows.segments[-1]
    return (first, *first.stride(), second, *second.stride())


def default_blocks_per_split(n_blocks: int, programs: int, tile: int = DEFAULT_TILE) -> int:
    """Blocks per split: enough splits to give ~256 programs in all, each a whole number of tiles."""
    want_splits = max(1, 256 // max(1, programs))
    per = math.ceil(max(1, n_blocks) / want_splits)
    return max(tile, math.ceil(per / tile) * tile)


def decode_attention_partials_triton(
    query: torch.Tensor,
    keys: CodedRows,
    values: CodedRows,
    *,
    scale: float,
    key_mask: torch.Tensor | None = None,
    blocks_per_split: int | None = None,
    tile: int = DEFAULT_TILE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split partials ``(m, denom, acc)`` computed by the Triton kernel.

    Same arguments, shapes and split boundaries as
    :func:`flashcodec.kernels.naive.decode_attention_partials` (``blocks_per_split=None`` picks
    :func:`default_blocks_per_split`). ``query [B, Hq, D]``; ``key_mask`` additive fp32 ``[B, S]``.
    A sink (:attr:`~flashcodec.kernels.naive.CodedRows.sink`) is hidden from the kernel through the
    mask and attended by :func:`~flashcodec.kernels.naive.sink_partial` (a few tokens), whose split
    follows the kernel's, as in the reference.
    """
    sink_mask, key_mask = key_mask, hide_sink(keys, values, key_mask, query.shape[0], query.device)
    b, hq, d = query.shape
    hkv = keys.segments[0].shape[1]
    groups = hq // hkv
    dv = values.tail.shape[-1]
    r, n_blocks = keys.block_size, keys.n_blocks
    if max(keys.synthesis.shape[1], values.synthesis.shape[1], r) > 64:
        raise ValueError(f"the Triton kernel unrolls at most 64 rows per block; got r={r}")
    per = blocks_per_split or default_blocks_per_split(n_blocks, b * hkv, tile)
    n_splits = math.ceil(n_blocks / per)
    parts = n_splits + 1
    dev = query.device
    m = torch.empty(b, hq, parts, dtype=torch.float32, device=dev)
    denom = torch.empty_like(m)
    acc = torch.empty(b, hq, parts, dv, dtype=torch.float32, device=dev)
    a_k = keys.synthesis.float().contiguous()
    a_v = values.synthesis.float().contiguous()
    mask = key_mask if key_mask is not None else a_k  # a dummy pointer when there is no mask
    mask_strides = tuple(key_mask.stride()) if key_mask is not None else (0, 0)
    _check_device(query)
    _codec_partial_kernel[(b * hkv, parts)](
        query, *query.stride(),
        *_segment_args(keys),
        *_scale_args(keys),
        *_offset_args(keys),
        *_channel_args(keys),
        a_k,
        *_segment_args(values),
        *_scale_args(values),
        *_offset_args(values),
        *_channel_args(values),
        a_v,
        keys.tail, *keys.tail.stride(),
        values.tail, *values.tail.stride(),
        mask, *mask_strides,
        m, denom, acc, *m.stride(), *acc.stride(),
        n_blocks, keys.tail.shape[2], n_splits, per, hkv, groups, d, dv, float(scale),
        R=r, RK=a_k.shape[1], RK0=keys.segments[0].shape[3], RV=a_v.shape[1], RV0=values.segments[0].shape[3],
        RP=_pow2(r), TP=_pow2(max(r, keys.tail.shape[2])),
        GP=_pow2(groups), DP=_pow2(d), DVP=_pow2(dv), TILE=tile,
        HAS_KS=keys.scales is not None, HAS_VS=values.scales is not None, HAS_MASK=key_mask is not None,
        HAS_KO=keys.offsets is not None, HAS_VO=values.offsets is not None,
        HAS_KC=keys.channel_scales is not None, HAS_VC=values.channel_scales is not None,
        PACKED_K0=keys.segments[0].dtype == torch.uint8, PACKED_K1=keys.segments[-1].dtype == torch.uint8,
        PACKED_V0=values.segments[0].dtype == torch.uint8, PACKED_V1=values.segments[-1].dtype == torch.uint8,
    )  # fmt: skip
    sink = sink_partial(query, keys, values, scale=scale, key_mask=sink_mask)
    if sink is not None:
        m = torch.cat([m, sink[0][..., None]], dim=-1)
        denom = torch.cat([denom, sink[1][..., None]], dim=-1)
        acc = torch.cat([acc, sink[2][:, :, None]], dim=-2)
    return m, denom, acc


def combine_partials_triton(
    m: torch.Tensor, denom: torch.Tensor, acc: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Log-sum-exp merge on the device: ``m, denom [B, Hq, P]``, ``acc [B, Hq, P, Dv]`` -> ``[B, Hq, Dv]``."""
    b, hq, parts, dv = acc.shape
    out = torch.empty(b, hq, dv, dtype=dtype, device=acc.device)
    _check_device(acc)
    _combine_kernel[(b * hq,)](
        m, denom, acc, m.stride(0), m.stride(1), m.stride(2), *acc.stride(),
        out, *out.stride(),
        hq, parts, dv,
        SP=_pow2(parts), DVP=_pow2(dv),
    )  # fmt: skip
    return out


def triton_decode_attention(
    query: torch.Tensor,
    keys: CodedRows,
    values: CodedRows,
    *,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    blocks_per_split: int | None = None,
    tile: int = DEFAULT_TILE,
) -> torch.Tensor:
    """Decode attention on coded rows with the Triton kernels: ``query [B, Hq, D]`` -> ``[B, Hq, Dv]``.

    Output in ``query.dtype``; ``scale`` defaults to ``D ** -0.5``. See
    :func:`flashcodec.kernels.naive.decode_attention_naive` for the arguments.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    m, denom, acc = decode_attention_partials_triton(
        query, keys, values, scale=scale, key_mask=key_mask, blocks_per_split=blocks_per_split, tile=tile
    )
    return combine_partials_triton(m, denom, acc, query.dtype)
