"""Materialization-free decode attention: one query token attends on the stored rows directly.

Every codec is linear along the sequence axis: block ``b`` of ``r`` tokens is ``K_b = A @ S_b``
with ``S_b`` the stored rows (jpeg: ``K`` DCT coefficients, dequantized with their int8 scales;
png: anchor + ``r - 1`` deltas) and ``A [r, R]`` the codec's synthesis matrix. Hence

    q . K[b*r + p] = (q . S_b^T) @ A[p]          out = sum_b (prob_b @ A) @ S_b  (+ the raw tail)

and the reconstructed ``[B, H, S, D]`` view is never built: :func:`codec_decode_attention` reads
the archive buffers and the raw tail of two :class:`~flashcodec.stream.CodecStream` s as they are
(int8 coefficients included) and never calls ``read()``.

Decode (one new token per sequence): :func:`codec_decode_attention` on the stored rows. The gain
in bytes read is ``R / r`` (jpeg ``keep_freqs < block_size``, and 1/4 more from int8); png stores
``r`` rows per block, so it is supported but saves nothing.

Multi-token steps (prefill, chunked prefill, verification): :func:`codec_prefill_attention`. The
coefficient form would need a ``[s, n_blocks * R]`` score tensor per head, so there the archived
blocks are decoded :data:`CHUNK_TOKENS` tokens' worth at a time and folded into an online softmax
(log-sum-exp): peak memory is one decoded chunk plus one pass's scores, never the whole view.
Given the step's own keys and values as appended (``step_keys`` / ``step_values``, what
:func:`flashcodec.hf.apply_codec_attention` passes by default), the step attends those tokens raw
and only the earlier ones through their codes.

Backends: ``"torch"`` (:mod:`flashcodec.kernels.naive`, split into chunks of blocks so its
temporaries stay bounded) and ``"triton"`` (:mod:`flashcodec.kernels.triton_attention`, a split-K
kernel plus a log-sum-exp combine; on CPU tensors it runs under the Triton interpreter).
``"auto"`` picks Triton for CUDA tensors when triton is importable, torch otherwise.
"""

from __future__ import annotations

import math
import numbers

import torch
from kvspec import KVConfigError, KVDtypeError, KVShapeError, KVValueError

from .kernels.naive import (
    CodedRows,
    decode_attention_naive,
    decoded_chunk,
    in_rotated_domain,
    prefill_attention_naive,
)
from .stream import SPARE_BLOCKS, CodecStream

__all__ = [
    "BACKENDS",
    "coded_rows",
    "additive_key_mask",
    "QUERY_DTYPES",
    "codec_decode_attention",
    "codec_prefill_attention",
    "materialized_decode_attention",
    "materialized_prefill_attention",
    "step_rows",
    "CHUNK_BLOCKS",
    "CHUNK_TOKENS",
    "chunk_blocks_for",
    "triton_available",
]

BACKENDS = ("auto", "torch", "triton")
#: query dtypes the attention functions take (the caches' dtypes; arithmetic runs in fp32)
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: bytes of fp32 rows one torch chunk may cast at once: bounds the temporaries on long sequences
TORCH_CHUNK_BYTES = 2 << 20
#: tokens' worth of archived blocks a multi-token step decodes at a time (:func:`chunk_blocks_for`)
CHUNK_TOKENS = 512
#: archived blocks a multi-token step decodes at a time at r = 8 (at least the archive's most spare blocks)
CHUNK_BLOCKS = max(CHUNK_TOKENS // 8, SPARE_BLOCKS)


def chunk_blocks_for(block_size: int) -> int:
    """The default chunk of a multi-token step, in blocks: :data:`CHUNK_TOKENS` tokens' worth
    (:data:`CHUNK_BLOCKS` = 64 at r = 8, 8 at r = 64; at least one block). The archive's spare
    capacity (at most 32 tokens) stays below it."""
    return max(1, CHUNK_TOKENS // block_size)


def triton_available() -> bool:
    """Whether ``import triton`` works here (the kernels are imported lazily)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def coded_rows(stream: CodecStream) -> CodedRows:
    """The stored rows of ``stream`` as the kernels read them: nothing decoded.

    The codec says how its parts are addressed (:meth:`flashcodec.BlockCodec.row_segments`; jpeg:
    the coefficients, int8 or not, and their scales; png: the anchors and the deltas, as views),
    its zero points if it has any (:meth:`flashcodec.BlockCodec.row_offsets`, jpeg-int4z), its
    synthesis matrix ``A [r, R]`` in fp32, and the stream's sink decoded (a few tokens, when the
    codec keeps one: :attr:`flashcodec.BlockCodec.sink_tokens`).
    """
    codec = stream.codec
    parts = stream.archived_parts()
    segments, scales = codec.row_segments(parts)
    synthesis = codec.synthesis_matrix(torch.float32, stream.device)
    channel = codec.channel_affine(parts)
    return CodedRows(
        segments,
        scales,
        synthesis,
        stream.tail(),
        codec.row_offsets(parts),
        *(channel or (None, None)),
        identity_synthesis=codec.synthesis_is_identity,
        rotation=codec.channel_rotation(stream.dim, stream.device),
        sink=stream.sink() if stream.sink_len else None,
    )


def _additive(mask: torch.Tensor, name: str) -> torch.Tensor:
    """A bool mask (True = attend) as additive fp32 (0 visible, -inf hidden); a floating-point mask
    as it is; ``KVDtypeError`` naming ``name`` for any other dtype."""
    if mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=torch.float32, device=mask.device)
        return torch.where(mask, zero, torch.full_like(zero, -math.inf))
    if not mask.is_floating_point():
        raise KVDtypeError(f"{name} must be bool or floating point; got {mask.dtype}")
    return mask


def additive_key_mask(key_mask: torch.Tensor | None, batch: int, seq_len: int) -> torch.Tensor | None:
    """Validate ``key_mask`` and return it as additive fp32 ``[B, S]`` (0 visible, -inf hidden).

    Accepts None, a bool ``[B, S]`` (True = attend) or a float ``[B, S]`` added to the scores;
    ``KVValueError`` when a row hides every key (its softmax would be NaN).
    """
    if key_mask is None:
        return None
    if not isinstance(key_mask, torch.Tensor):
        raise KVDtypeError(f"key_mask must be a torch.Tensor or None; got {type(key_mask).__name__}")
    if tuple(key_mask.shape) != (batch, seq_len):
        raise KVShapeError(
            f"key_mask must have shape [B, S] = {(batch, seq_len)}; got {tuple(key_mask.shape)}"
        )
    mask = _additive(key_mask, "key_mask").float()
    if mask.numel():
        # a row with no visible key has no softmax: it would come back NaN
        hidden = torch.isneginf(mask).all(dim=-1) | torch.isnan(mask).any(dim=-1)
        if bool(hidden.any()):
            rows = hidden.nonzero().flatten().tolist()
            raise KVValueError(
                f"key_mask must leave every sequence at least one key to attend to (and hold no NaN); "
                f"batch rows {rows} have none"
            )
    return mask


def _check_call(
    query: object,
    key_stream: object,
    value_stream: object,
    scale: object,
    backend: object,
    blocks_per_split: object,
) -> None:
    """Raise the kvspec error for a call :func:`codec_decode_attention` cannot serve; reads only."""
    if not isinstance(query, torch.Tensor):
        raise KVDtypeError(f"query must be a torch.Tensor; got {type(query).__name__}")
    for name, s in (("key_stream", key_stream), ("value_stream", value_stream)):
        if not isinstance(s, CodecStream):
            raise KVDtypeError(f"{name} must be a flashcodec CodecStream; got {type(s).__name__}")
    assert isinstance(key_stream, CodecStream) and isinstance(value_stream, CodecStream)
    if query.dim() != 4 or query.shape[2] != 1:
        raise KVShapeError(
            f"query must be [B, Hq, 1, D] (one new token per sequence); got shape {tuple(query.shape)}"
        )
    if not query.is_floating_point():
        raise KVDtypeError(f"query must be floating point; got {query.dtype}")
    if query.dtype not in QUERY_DTYPES:
        # the kernels compute in fp32: an fp64 query would come back fp64 with fp32 precision
        allowed = ", ".join(str(dt).removeprefix("torch.") for dt in QUERY_DTYPES)
        raise KVDtypeError(f"query dtype must be one of {allowed}; got {query.dtype}")
    b, hq, _, d = query.shape
    ks, vs = key_stream, value_stream
    if (ks.batch, ks.heads, ks.seq_len, ks.block_size) != (vs.batch, vs.heads, vs.seq_len, vs.block_size):
        raise KVShapeError(
            "key_stream and value_stream must agree on (B, H, S, block_size); got "
            f"{(ks.batch, ks.heads, ks.seq_len, ks.block_size)} and {(vs.batch, vs.heads, vs.seq_len, vs.block_size)}"
        )
    if ks.seq_len == 0:
        raise KVShapeError("the streams hold no token: there is nothing to attend to")
    if b != ks.batch or d != ks.dim:
        raise KVShapeError(
            f"query [B, Hq, 1, D] must have B={ks.batch}, D={ks.dim}; got shape {tuple(query.shape)}"
        )
    if hq % ks.heads:
        raise KVShapeError(
            f"query heads Hq={hq} must be a multiple of the key/value heads Hkv={ks.heads} (GQA groups)"
        )
    if query.device != ks.device or vs.device != ks.device:
        raise KVDtypeError(f"query (on {query.device}) and the streams (on {ks.device}) must share a device")
    _check_positive("scale", scale)
    if backend not in BACKENDS:
        raise KVConfigError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if blocks_per_split is not None and (
        isinstance(blocks_per_split, bool)
        or not isinstance(blocks_per_split, numbers.Integral)
        or blocks_per_split < 1
    ):
        raise KVConfigError(f"blocks_per_split must be None or an integer >= 1; got {blocks_per_split!r}")


def _torch_chunk_blocks(keys: CodedRows, values: CodedRows) -> int:
    """Blocks per torch chunk so that one chunk's fp32 rows stay within :data:`TORCH_CHUNK_BYTES`."""
    # elements of one block over the batch and heads: B * H * R * D
    per_block = max(
        sum(seg.shape[0] * seg.shape[1] * seg.shape[3] * rows.tail.shape[-1] for seg in rows.segments)
        for rows in (keys, values)
    )
    return max(16, TORCH_CHUNK_BYTES // (4 * max(1, per_block)))


@torch.no_grad()
def codec_decode_attention(
    query: torch.Tensor,
    key_stream: CodecStream,
    value_stream: CodecStream,
    *,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    backend: str = "auto",
    blocks_per_split: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of one decode token per sequence over coded keys/values, without the view.

    Args:
        query: ``[B, Hq, 1, D]`` (post-RoPE, like the keys that were appended); fp32, fp16 or bf16.
            ``Hq = G * Hkv``: query head ``h * G + g`` reads key/value head ``h`` (GQA, the order
            of transformers' ``repeat_kv``).
        key_stream, value_stream: the layer's streams (``[B, Hkv, S, D]`` and ``[B, Hkv, S, Dv]``),
            e.g. ``cache.keys`` / ``cache.values`` of a :class:`flashcodec.CodecKVCache`; the new
            token's key and value must already be appended.
        scale: score scale, default ``D ** -0.5``.
        key_mask: None, bool ``[B, S]`` (True = attend) or additive float ``[B, S]``, e.g. for
            left-padded batches; every row must leave at least one key visible.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see the module docstring).
        blocks_per_split: archived blocks per split (torch: per chunk; Triton: per program);
            default: torch chunks cast at most :data:`TORCH_CHUNK_BYTES` of rows to fp32 at a time;
            Triton aims at ~256 programs.
        softcap: None, or a logit soft-cap ``c > 0``: scores pass through ``c * tanh(score / c)``
            before the mask (Gemma 2).
        sinks: None, or one attention-sink logit per query head ``[Hq]`` (gpt-oss): it joins each
            softmax's denominator and carries no value. With either, ``"auto"`` runs the torch
            kernel (the Triton kernel takes neither).

    Returns:
        ``[B, Hq, 1, Dv]`` in ``query.dtype``; arithmetic in fp32 from the stored rows.

    Raises kvspec errors (``KVShapeError``, ``KVDtypeError``, ``KVConfigError``, ``KVValueError``)
    for calls it cannot serve; the streams are only read, never changed.
    """
    _check_call(query, key_stream, value_stream, scale, backend, blocks_per_split)
    b, hq, _, d = query.shape
    _check_softcap_and_sinks(softcap, sinks, hq)
    extras = softcap is not None or sinks is not None
    if backend == "triton" and extras:
        raise KVConfigError("backend='triton' takes no softcap or sinks; use backend='torch' or 'auto'")
    mask = additive_key_mask(key_mask, b, key_stream.seq_len)
    if mask is not None:
        mask = mask.to(query.device)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    keys, values = coded_rows(key_stream), coded_rows(value_stream)
    if backend == "auto":
        backend = "triton" if query.is_cuda and triton_available() and not extras else "torch"
    if backend == "triton":
        from .kernels.triton_attention import triton_decode_attention

        # the kernel reads every token in one basis: a rotated archive's tail and query rotate too
        q, keys, values, back = in_rotated_domain(query[:, :, 0], keys, values)
        out = triton_decode_attention(
            q, keys, values, scale=scale, key_mask=mask, blocks_per_split=blocks_per_split
        )
        out = back(out)
    else:
        out = decode_attention_naive(
            query[:, :, 0],
            keys,
            values,
            scale=scale,
            key_mask=mask,
            blocks_per_split=blocks_per_split or _torch_chunk_blocks(keys, values),
            softcap=None if softcap is None else float(softcap),
            sinks=sinks,
        )
    return out.unsqueeze(2)


def _check_positive(name: str, value: object) -> None:
    """``KVConfigError`` unless ``value`` is None or a finite number > 0."""
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise KVConfigError(f"{name} must be None or a finite number > 0; got {value!r}")


def _check_softcap_and_sinks(softcap: object, sinks: object, heads: int) -> None:
    """``KVConfigError`` unless ``softcap`` is None or a finite number > 0 and ``sinks`` None or a
    floating tensor of ``heads`` logits."""
    _check_positive("softcap", softcap)
    if sinks is not None and (
        not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.numel() != heads
    ):
        raise KVConfigError(
            f"sinks must be None or a floating tensor of one logit per query head ({heads}); got "
            f"{type(sinks).__name__} {tuple(getattr(sinks, 'shape', ()))}"
        )


@torch.no_grad()
def materialized_decode_attention(
    query: torch.Tensor,
    key_stream: CodecStream,
    value_stream: CodecStream,
    *,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The materialized path, for comparison: ``read()`` both views, then SDPA in ``query.dtype``.

    Same arguments and result as :func:`codec_decode_attention`; builds (or updates) the memoized
    ``[B, H, S, D]`` views, which is exactly what the coefficient-domain path avoids.
    """
    _check_call(query, key_stream, value_stream, scale, "torch", None)
    mask = additive_key_mask(key_mask, query.shape[0], key_stream.seq_len)
    k, v = key_stream.read(), value_stream.read()
    attn_mask = None if mask is None else mask[:, None, None, :].to(query.dtype)
    return torch.nn.functional.scaled_dot_product_attention(
        query, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=query.shape[1] != k.shape[1]
    )


def _check_prefill(
    query: object, key_stream: object, value_stream: object, scale: object, chunk_blocks: object
) -> None:
    """Raise the kvspec error for a call :func:`codec_prefill_attention` cannot serve; reads only."""
    if chunk_blocks is not None and (
        isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, numbers.Integral) or chunk_blocks < 1
    ):
        raise KVConfigError(f"chunk_blocks must be None or an integer >= 1; got {chunk_blocks!r}")
    if isinstance(query, torch.Tensor) and query.dim() == 4 and query.shape[2] >= 1:
        one = query[:, :, :1]
        _check_call(one, key_stream, value_stream, scale, "torch", None)
        assert isinstance(key_stream, CodecStream)
        if query.shape[2] > key_stream.seq_len:
            raise KVShapeError(
                f"query has s={query.shape[2]} tokens but the streams hold only {key_stream.seq_len}: "
                "append the new keys and values first"
            )
        return
    if not isinstance(query, torch.Tensor):
        raise KVDtypeError(f"query must be a torch.Tensor; got {type(query).__name__}")
    raise KVShapeError(f"query must be [B, Hq, s, D] with s >= 1; got shape {tuple(query.shape)}")


def _prefill_mask(mask: object, batch: int, heads: int, s: int, total: int, device) -> torch.Tensor | None:
    """``attn_mask`` as additive fp32 ``[B, 1 | Hq, s, S]``; None stays None (causal)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise KVDtypeError(f"attn_mask must be a torch.Tensor or None; got {type(mask).__name__}")
    if (
        mask.dim() != 4
        or mask.shape[0] != batch
        or mask.shape[1] not in (1, heads)
        or tuple(mask.shape[2:])
        != (
            s,
            total,
        )
    ):
        raise KVShapeError(
            f"attn_mask must have shape [B, 1 or Hq, s, S] = [{batch}, 1 or {heads}, {s}, {total}]; "
            f"got {tuple(mask.shape)}"
        )
    return _additive(mask, "attn_mask").to(device=device, dtype=torch.float32)


def _check_step(name: str, step: object, stream: CodecStream, s: int) -> None:
    """Raise the kvspec error unless ``step`` is the ``[B, H, s, D]`` raw form of the stream's last
    ``s`` tokens (its shape, dtype and device)."""
    if not isinstance(step, torch.Tensor):
        raise KVDtypeError(f"{name} must be a torch.Tensor or None; got {type(step).__name__}")
    want = (stream.batch, stream.heads, s, stream.dim)
    if tuple(step.shape) != want:
        raise KVShapeError(f"{name} must have shape [B, H, s, D] = {list(want)}; got {list(step.shape)}")
    if step.dtype != stream.dtype or step.device != stream.device:
        raise KVDtypeError(
            f"{name} must be {stream.dtype} on {stream.device} like its stream; got {step.dtype} on {step.device}"
        )


def step_rows(rows: CodedRows, step: torch.Tensor) -> CodedRows:
    """``rows`` with its last ``s = step.shape[2]`` tokens taken from ``step`` (their raw form).

    The archived blocks wholly before the step stay coded (views, nothing decoded); the tokens
    between them and the step (at most ``r - 1`` of an archived block, or the stored tail's) are
    decoded and put, with ``step``, into the raw tail the kernels attend to directly.
    """
    s = step.shape[2]
    r, n = rows.block_size, rows.n_blocks
    before = rows.seq_len - s
    keep = min(n, before // r)
    parts = []
    if keep < n:  # the step starts inside archived block `keep` (or at its first token)
        if before > keep * r:
            parts.append(decoded_chunk(rows, keep, keep + 1)[:, :, : before - keep * r])
    elif before > n * r:
        parts.append(rows.tail[:, :, : before - n * r])
    parts.append(step.to(rows.tail.dtype))

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:, :, :keep]

    return rows._replace(
        segments=tuple(seg[:, :, :keep] for seg in rows.segments),
        scales=cut(rows.scales),
        offsets=cut(rows.offsets),
        channel_scales=cut(rows.channel_scales),
        channel_offsets=cut(rows.channel_offsets),
        tail=torch.cat(parts, dim=2) if len(parts) > 1 else parts[0],
    )


def _prefill_split_tail(
    query: torch.Tensor,
    keys: CodedRows,
    values: CodedRows,
    *,
    scale: float,
    mask: torch.Tensor | None,
    chunk_blocks: int,
    tail_tokens: int = CHUNK_TOKENS,
    score_elements: int = 1 << 18,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~flashcodec.kernels.naive.prefill_attention_naive` with the raw tail cut into chunks
    of ``tail_tokens``: with the step's own tokens raw, the tail holds the whole step, and one
    causal chunk the size of the prompt would score every query against every key (twice the
    work of chunks that skip the keys after a query). Same arguments, same result."""
    return prefill_attention_naive(
        query,
        keys,
        values,
        scale=scale,
        mask=mask,
        chunk_blocks=chunk_blocks,
        score_elements=score_elements,
        tail_tokens=tail_tokens,
        softcap=softcap,
        sinks=sinks,
    )


@torch.no_grad()
def codec_prefill_attention(
    query: torch.Tensor,
    key_stream: CodecStream,
    value_stream: CodecStream,
    *,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    chunk_blocks: int | None = None,
    step_keys: torch.Tensor | None = None,
    step_values: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the ``s`` newest tokens over the coded streams, without the whole-history view.

    Args:
        query: ``[B, Hq, s, D]``: the queries of the last ``s`` tokens of the streams (their keys
            and values already appended), post-RoPE; ``Hq = G * Hkv`` as in :func:`codec_decode_attention`.
        key_stream, value_stream: the layer's streams (``S`` tokens each).
        scale: score scale, default ``D ** -0.5``.
        attn_mask: None (causal: query ``i`` sees the keys up to its own position ``S - s + i``),
            or bool ``[B, 1 | Hq, s, S]`` (True = attend) or additive float of that shape, used
            instead of the causal rule (transformers' 4-D masks: padding, custom masks).
        chunk_blocks: archived blocks decoded at a time (default :func:`chunk_blocks_for` the
            block size: 512 tokens' worth).
        step_keys, step_values: both or neither: the raw ``[B, Hkv, s, D]`` / ``[B, Hkv, s, Dv]``
            keys and values of the ``s`` query tokens as they were appended (stream dtype). Given,
            the step attends its own tokens in that form and the earlier tokens as stored
            (:func:`step_rows`), as transformers' ``QuantizedCache`` does in a prefill.
        softcap, sinks: as :func:`codec_decode_attention`.

    Returns:
        ``[B, Hq, s, Dv]`` in ``query.dtype``; fp32 arithmetic on keys and values rounded to the
        stream dtype, i.e. on exactly the values the materialized view would hold. A query that sees
        no key gets zeros. Peak temporaries: one decoded chunk of keys and values (``chunk_blocks *
        r`` tokens) and at most ``2**18`` scores; the streams are only read, no view is built.
    """
    _check_prefill(query, key_stream, value_stream, scale, chunk_blocks)
    b, hq, s, d = query.shape
    _check_softcap_and_sinks(softcap, sinks, hq)
    extras = dict(softcap=None if softcap is None else float(softcap), sinks=sinks)
    if (step_keys is None) != (step_values is None):
        raise KVConfigError("step_keys and step_values must be given together (or neither)")
    if step_keys is not None:
        _check_step("step_keys", step_keys, key_stream, s)
        _check_step("step_values", step_values, value_stream, s)
    mask = _prefill_mask(attn_mask, b, hq, s, key_stream.seq_len, query.device)
    keys, values = coded_rows(key_stream), coded_rows(value_stream)
    if step_keys is not None:
        return _prefill_split_tail(
            query,
            step_rows(keys, step_keys),
            step_rows(values, step_values),
            scale=1.0 / math.sqrt(d) if scale is None else float(scale),
            mask=mask,
            chunk_blocks=chunk_blocks or chunk_blocks_for(key_stream.block_size),
            **extras,
        )
    return prefill_attention_naive(
        query,
        keys,
        values,
        scale=1.0 / math.sqrt(d) if scale is None else float(scale),
        mask=mask,
        chunk_blocks=chunk_blocks or chunk_blocks_for(key_stream.block_size),
        **extras,
    )


@torch.no_grad()
def materialized_prefill_attention(
    query: torch.Tensor,
    key_stream: CodecStream,
    value_stream: CodecStream,
    *,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The materialized path, for comparison: ``read()`` both views, then causal (or masked) SDPA.

    Same arguments and result as :func:`codec_prefill_attention`; builds the memoized views.
    """
    _check_prefill(query, key_stream, value_stream, scale, None)
    b, hq, s, _ = query.shape
    total = key_stream.seq_len
    mask = _prefill_mask(attn_mask, b, hq, s, total, query.device)
    if mask is None:
        pos_q = torch.arange(total - s, total, device=query.device)
        visible = torch.arange(total, device=query.device)[None, :] <= pos_q[:, None]
        mask = torch.zeros(s, total, device=query.device).masked_fill(~visible, -math.inf)[None, None]
    k, v = key_stream.read(), value_stream.read()
    return torch.nn.functional.scaled_dot_product_attention(
        query, k, v, attn_mask=mask.to(query.dtype), scale=scale, enable_gqa=hq != k.shape[1]
    )
