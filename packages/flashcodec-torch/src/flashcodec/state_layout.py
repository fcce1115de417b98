"""Checks of a saved cache state against its metadata, before anything is rebuilt from it.

:meth:`flashcodec.CodecKVCache.from_state` trusts nothing it is given: a state from another codec,
a truncated or edited array, or a ``meta_state`` whose ``block_size`` was changed would otherwise
rebuild a cache that returns other values, or fails deep inside a later call. Every array is checked
against what the codec in ``meta_state`` stores (count, shape, dtype, device), the keys against the
values and the token count against the ``offset`` recorded in ``meta_state``; the contents are the
codec's to check (:meth:`flashcodec.BlockCodec.check_stored`, ``TailCoder.check_stored``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from kvspec import KVDataError

from .codecs.base import BlockCodec, check_finite_part

__all__ = ["check_state_layout"]


def check_state_layout(
    codec: BlockCodec,
    arrays: tuple[object, ...],
    *,
    supported_dtypes: tuple[torch.dtype, ...],
    offset: int,
    check_finite: bool,
    dtype: torch.dtype | None = None,
) -> None:
    """Raise ``KVDataError`` naming the array and what is wrong unless ``arrays`` is a state of
    ``codec`` holding ``offset`` tokens in ``dtype`` (``None``, as an empty cache's meta_state
    records: the raw tail's dtype; a coded tail needs it recorded)."""
    n_tail = len(codec.tail_coder.part_specs(1))
    n_parts = len(codec.stream_state_specs(1))
    value_codec = codec.value_codec  # the codec itself but for codecs that code values apart (kivi)
    n_value_parts = len(value_codec.stream_state_specs(1))
    if not arrays:
        if offset:
            raise KVDataError(f"state is empty but meta_state records offset={offset}")
        return
    if len(arrays) != n_parts + n_value_parts:
        raise KVDataError(
            f"state must hold {n_parts + n_value_parts} tensors for {codec!r} ({n_parts} for the keys: "
            f"{_names(codec)}, then {n_value_parts} for the values: {_names(value_codec)}); got {len(arrays)}"
        )
    for i, t in enumerate(arrays):
        if not isinstance(t, torch.Tensor):
            raise KVDataError(f"state[{i}] must be a torch.Tensor; got {type(t).__name__}")
    k_arrays, v_arrays = arrays[:n_parts], arrays[n_parts:]
    if dtype is None and codec.window_bits is not None:
        raise KVDataError(
            f"meta_state must record the cache's dtype for {codec!r} (its tail is stored in int8); "
            "this meta_state has none (an empty cache's?)"
        )
    _check_stream(codec, k_arrays, "keys", supported_dtypes, check_finite, dtype)  # type: ignore[arg-type]
    _check_stream(value_codec, v_arrays, "values", supported_dtypes, check_finite, dtype)  # type: ignore[arg-type]
    k_tail, v_tail = k_arrays[-n_tail], v_arrays[-n_tail]
    assert isinstance(k_tail, torch.Tensor) and isinstance(v_tail, torch.Tensor)
    k_blocks, v_blocks = k_arrays[0].shape[2], v_arrays[0].shape[2]  # type: ignore[union-attr]
    if k_tail.shape[:3] != v_tail.shape[:3] or k_blocks != v_blocks:
        raise KVDataError(
            f"keys and values state must agree on B, H, blocks and tail length; got keys tail "
            f"{tuple(k_tail.shape)} with {k_blocks} blocks, values tail {tuple(v_tail.shape)} with {v_blocks} blocks"
        )
    if k_tail.dtype != v_tail.dtype or k_tail.device != v_tail.device:
        raise KVDataError(
            f"keys and values state must share dtype and device; got {k_tail.dtype} on {k_tail.device} "
            f"and {v_tail.dtype} on {v_tail.device}"
        )
    tokens = k_blocks * codec.block_size + k_tail.shape[2]
    if tokens != offset:
        raise KVDataError(
            f"state holds {k_blocks} blocks of block_size={codec.block_size} + {k_tail.shape[2]} tail tokens "
            f"= {tokens} tokens, but meta_state records offset={offset} (a meta_state of another cache, "
            "or an edited block_size?)"
        )


def _names(codec: BlockCodec) -> str:
    return ", ".join(spec.name for spec in codec.stream_state_specs(1))


def _check_stream(
    codec: BlockCodec,
    arrays: tuple[torch.Tensor, ...],
    name: str,
    supported_dtypes: tuple[torch.dtype, ...],
    check_finite: bool,
    dtype: torch.dtype | None,
) -> None:
    n_parts, n_sink = len(codec.part_specs(1)), len(codec.sink_specs(1))
    parts, sinks, tails = arrays[:n_parts], arrays[n_parts : n_parts + n_sink], arrays[n_parts + n_sink :]
    tail = tails[0]
    r, w = codec.block_size, codec.raw_window
    if tail.dim() != 4 or tail.shape[2] >= r + w or 0 in (tail.shape[0], tail.shape[1], tail.shape[3]):
        bound = f"block_size={r}" if not w else f"block_size + raw_window={r + w}"
        raise KVDataError(
            f"{name} tail must be [B, H, t, D] with B, H, D >= 1 and t < {bound}; got {tuple(tail.shape)}"
        )
    raw = codec.window_bits is None
    if raw and tail.dtype not in supported_dtypes:
        allowed = ", ".join(str(dt).removeprefix("torch.") for dt in supported_dtypes)
        raise KVDataError(f"{name} tail dtype must be one of {allowed}; got {tail.dtype}")
    if raw and dtype is not None and tail.dtype != dtype:
        raise KVDataError(f"{name} tail dtype must be the recorded dtype {dtype}; got {tail.dtype}")
    stream_dtype = tail.dtype if raw else dtype
    b, h, t, d = tail.shape
    try:
        codec.check_dim(d)
    except ValueError as err:
        raise KVDataError(f"{name} tail: {err}") from err
    for spec, part in zip(codec.tail_coder.part_specs(d), tails, strict=True):
        want_shape, want_dtype = (b, h, t, *spec.shape), spec.dtype or stream_dtype
        if tuple(part.shape) != want_shape or part.dtype != want_dtype or part.device != tail.device:
            raise KVDataError(
                f"{name} {spec.name} must be {want_shape} {want_dtype} on {tail.device} for {codec!r}; "
                f"got {tuple(part.shape)} {part.dtype} on {part.device}"
            )
    _contents(name, lambda: codec.tail_coder.check_stored(tails, check_finite=check_finite))
    n = parts[0].shape[2] if parts[0].dim() >= 3 else -1
    for spec, part in zip(codec.part_specs(d), parts, strict=True):
        want_shape = (b, h, n, *spec.shape)
        want_dtype = spec.dtype or stream_dtype
        if n < 0 or tuple(part.shape) != want_shape or part.dtype != want_dtype or part.device != tail.device:
            raise KVDataError(
                f"{name} part {spec.name!r} must be {want_shape} {want_dtype} on {tail.device} for {codec!r}; "
                f"got {tuple(part.shape)} {part.dtype} on {part.device}"
            )
    _contents(name, lambda: codec.check_stored(parts, check_finite=check_finite))
    # the sink: the codec's sink_tokens tokens once a block is archived, none before
    k = codec.sink_tokens if n > 0 else 0
    for spec, part in zip(codec.sink_specs(d), sinks, strict=True):
        want_shape, want_dtype = (b, h, k, *spec.shape), spec.dtype or stream_dtype
        if tuple(part.shape) != want_shape or part.dtype != want_dtype or part.device != tail.device:
            raise KVDataError(
                f"{name} {spec.name} must be {want_shape} {want_dtype} on {tail.device} for {codec!r} "
                f"({n} blocks archived); got {tuple(part.shape)} {part.dtype} on {part.device}"
            )
    for spec, part in zip(codec.sink_specs(d), sinks, strict=True):  # what the tail coder writes
        if part.numel():
            finite = check_finite or spec.dtype is not None  # a raw sink only when asked, as a raw tail
            _contents(
                name, lambda spec=spec, part=part, f=finite: check_finite_part(spec, part, check_finite=f)
            )


def _contents(name: str, check: Callable[[], None]) -> None:
    """Run a codec's own content check, its error naming the stream (``keys`` / ``values``)."""
    try:
        check()
    except KVDataError as err:
        raise KVDataError(f"{name} {err}") from None
