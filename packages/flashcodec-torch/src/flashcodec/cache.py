"""CodecKVCache: a standalone KV cache that stores the sequence axis block-coded.

Keys and values each live in a :class:`flashcodec.stream.CodecStream`: tokens collect in a raw
tail; every complete block of ``block_size`` tokens is encoded once (one batched GEMM / diff for
all blocks that complete in a call) and written in place into a capacity-doubled archive; reads
return the memoized reconstruction plus the raw tail.

The class meets the kvspec ``KVCacheLayer`` protocol (``update_and_fetch``, ``offset``, ``nbytes``,
``raw_nbytes``, ``trim``, ``state`` / ``meta_state``, ``from_state``, ``empty``), so the transformers
backend and the conformance adapter wrap the same object.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from typing import Any

import torch
from kvspec import (
    KVConfigError,
    KVDataError,
    KVDtypeError,
    KVShapeError,
    KVTrimError,
    KVValueError,
    check_kv_pair,
    trim_count,
)

from .codecs import BlockCodec, keyword_codec, make_codec
from .state_layout import check_state_layout
from .storage import CodecStorage
from .stream import CodecStream
from .validate import all_finite, batch_index, check_bool, check_int

__all__ = ["CodecKVCache", "SUPPORTED_DTYPES"]

#: input dtypes a cache accepts
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_BY_NAME = {str(dt).split(".")[-1]: dt for dt in SUPPORTED_DTYPES}
#: meta_state format: the codec, the offset (from_state checks it against the arrays) and the
#: dtype (an int8 tail does not carry it: ``window_bits=8``)
_META_VERSION = "flashcodec-cache-3"


class CodecKVCache:
    """Block-coded KV cache for one attention layer.

    The codec is given as an object, ``CodecKVCache(codec=JPEGCodec(block_size=8, keep_freqs=2))``,
    or in the keyword form, ``CodecKVCache(mode="jpeg", block_size=8, keep_freqs=2)``, which builds
    the same object (:func:`flashcodec.codecs.make_codec`). Giving both is a ``KVConfigError``.

    Args:
        keyword_form, codec_options: the codec in the keyword form, ``mode`` (a registry name:
            ``"jpeg"``, ``"png"``, ``"jpeg-int4z"``, ``"kivi"``, ...; default ``"jpeg"``) and the
            fields of that codec class (jpeg: ``block_size``, ``keep_freqs``, ``quant_bits``; png:
            ``block_size``, ``keep_ratio``, ``delta_dtype``; kivi: ``key_bits``, ``value_bits``,
            ...). Up to five may be given by position, in the order ``mode, block_size,
            keep_freqs, keep_ratio, quant_bits`` (:func:`flashcodec.codecs.keyword_codec`).
        codec: a codec object (:class:`flashcodec.JPEGCodec`, :class:`flashcodec.PNGCodec`, or any
            registered :class:`flashcodec.BlockCodec`), instead of the keyword form.
        check_finite: reject NaN / inf input with ``KVValueError`` (default True). One NaN would
            spread over its whole block through the transform; the check costs a reduction per call.
        initial_blocks: archive capacity allocated with the first complete block (then doubled), never
            more than ``flashcodec.stream.spare_blocks(block_size)`` blocks beyond those in use (4
            blocks and at most 32 tokens).

    Shapes: keys ``[B, H, S, D]``, values ``[B, H, S, Dv]``; dtype fp32, fp16 or bf16, the same for
    both, on one device. B, H, D, Dv, dtype and device are fixed by the first call (``reset`` or
    ``forward`` frees them). Every method that raises leaves the cache exactly as it was.

    The cache is storage, not a differentiable op: writes run under ``torch.no_grad``
    (the codecs themselves are differentiable).
    """

    def __init__(
        self,
        *keyword_form: Any,
        codec: BlockCodec | None = None,
        check_finite: bool = True,
        initial_blocks: int = 16,
        **codec_options: Any,
    ):
        self.codec: BlockCodec = keyword_codec(*keyword_form, codec=codec, **codec_options)
        self.check_finite = check_bool("check_finite", check_finite)
        self.initial_blocks = check_int("initial_blocks", initial_blocks, low=1)
        self.keys: CodecStream | None = None
        self.values: CodecStream | None = None

    def __repr__(self) -> str:
        return f"CodecKVCache({self.codec!r}, offset={self.offset})"

    # ------------------------------------------------------------------ validation
    def check_input(
        self, keys: object, values: object, *, fresh: bool | None = None, allow_empty: bool = False
    ) -> None:
        """Raise the kvspec error :meth:`append` would raise for ``(keys, values)``; never mutates.

        ``fresh``: check as for an empty cache (``forward``); default: as the next append would.
        ``allow_empty``: accept ``S = 0`` (both), checking everything else (the transformers layer
        passes empty steps through).
        """
        if fresh is None:
            fresh = self.keys is None
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor):
                raise KVDtypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
        expected = None
        if not fresh and self.keys is not None and self.values is not None:
            expected = (self.keys.batch, self.keys.heads, self.keys.dim, self.values.dim)
        k_shape, v_shape = tuple(keys.shape), tuple(values.shape)
        if allow_empty and len(k_shape) == len(v_shape) == 4 and k_shape[2] == v_shape[2] == 0:
            k_shape, v_shape = (*k_shape[:2], 1, k_shape[3]), (*v_shape[:2], 1, v_shape[3])
        check_kv_pair(k_shape, v_shape, keys.dtype, values.dtype, expected)
        if keys.dtype not in SUPPORTED_DTYPES:
            allowed = ", ".join(_DTYPE_BY_NAME)
            raise KVDtypeError(f"keys/values dtype must be one of {allowed}; got {keys.dtype}")
        for t in (keys, values):
            self.codec.check_dim(t.shape[-1])
        if keys.device != values.device:
            raise KVDtypeError(
                f"keys (on {keys.device}) and values (on {values.device}) must be on one device"
            )
        if expected is not None and self.keys is not None:
            if keys.dtype != self.keys.dtype:
                raise KVDtypeError(
                    f"dtype is fixed by the first update at {self.keys.dtype}; got {keys.dtype}"
                )
            if keys.device != self.keys.device:
                raise KVDtypeError(
                    f"device is fixed by the first update at {self.keys.device}; got {keys.device}"
                )
        if not fresh:
            self._check_writable("append")
        if self.check_finite:
            for name, t in (("keys", keys), ("values", values)):
                if not all_finite(t):
                    raise KVValueError(
                        f"{name} contain NaN or infinity (pass check_finite=False to skip this check)"
                    )

    def _check_writable(self, what: str) -> None:
        """``KVDtypeError`` when a buffer written in place was made under ``torch.inference_mode``
        and this call runs outside it: torch refuses in-place writes to it (checked before anything
        changes)."""
        if (
            self.keys is not None
            and self.values is not None
            and (self.keys.buffers_are_inference() or self.values.buffers_are_inference())
            and not torch.is_inference_mode_enabled()
        ):
            raise KVDtypeError(
                f"cannot {what}: the cache was filled under torch.inference_mode(), so its buffers are inference "
                "tensors that torch lets change only inside inference_mode; call it inside too (or reset() first)"
            )

    # ------------------------------------------------------------------ writes
    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``keys [B, H, S, D]`` and ``values [B, H, S, Dv]``; return the full views.

        Every block that completes is archived in one batched encode; the rest stays raw.
        Returns ``(keys [B, H, S_total, D], values [B, H, S_total, Dv])`` in the input dtype:
        archived tokens reconstructed, tail tokens raw. The returned tensors are views of the
        memoized buffers, valid until the next call that changes the cache. A read that fails
        (out of memory growing the view) undoes the append: the cache is as it was before the call.
        """
        self.check_input(keys, values)
        undo = self._append_to(self._streams_for(keys, values), keys, values)
        try:
            return self.read()
        except BaseException:
            undo()
            raise

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append like :meth:`update_and_fetch`, without reading: no view is built or updated.

        For consumers that attend on the stored rows (:func:`flashcodec.attention.codec_decode_attention`).
        """
        self.check_input(keys, values)
        self._append_to(self._streams_for(keys, values), keys, values)

    def _streams_for(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[CodecStream, CodecStream]:
        if self.keys is None or self.values is None:
            return self._new_streams(keys, values)
        return self.keys, self.values

    def _append_to(
        self, streams: tuple[CodecStream, CodecStream], keys: torch.Tensor, values: torch.Tensor
    ) -> Callable[[], None]:
        """Encode and allocate for both streams first, then commit both: an error (a coefficient
        overflowing its storage dtype, out of memory) leaves the cache as it was, never one stream
        a block ahead of the other. Returns the undo of the whole append (see
        :meth:`CodecStream.commit_append`)."""
        plans = []
        for name, stream, x in (("keys", streams[0], keys), ("values", streams[1], values)):
            plan = stream.prepare_append(x.detach())
            if self.check_finite:
                _check_stored(name, self.codec, plan.parts, x.dtype)
            plans.append(plan)
        previous = (self.keys, self.values)
        self.keys, self.values = streams
        undos = [stream.commit_append(plan) for stream, plan in zip(streams, plans, strict=True)]

        def undo() -> None:
            for u in undos:
                u()
            self.keys, self.values = previous

        return undo

    def forward(self, k_seq: torch.Tensor, v_seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-sequence fill: start over (as after :meth:`reset`) and store ``k_seq`` / ``v_seq``.

        Complete blocks are archived directly, so attention over the returned view sees block-level
        reconstructions of the prompt (exact on the lossless tiers). Shapes as :meth:`update_and_fetch`.
        """
        self.check_input(k_seq, v_seq, fresh=True)
        undo = self._append_to(self._new_streams(k_seq, v_seq), k_seq, v_seq)  # replaces the streams
        try:
            return self.read()
        except BaseException:
            undo()  # the old streams back, untouched
            raise

    def decode_step(self, new_k: torch.Tensor, new_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Incremental decode: append ``new_k [B, H, s, D]`` / ``new_v [B, H, s, Dv]`` (usually ``s = 1``).

        Returns the full views like :meth:`update_and_fetch`.
        """
        return self.update_and_fetch(new_k, new_v)

    def _new_streams(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[CodecStream, CodecStream]:
        """Empty key and value streams for the shapes of ``keys`` / ``values`` (not installed yet)."""
        b, h, _, d = keys.shape
        common = dict(dtype=keys.dtype, device=keys.device, initial_blocks=self.initial_blocks)
        return (
            CodecStream(self.codec, b, h, d, **common),
            CodecStream(self.codec.value_codec, b, h, values.shape[-1], **common),
        )

    # ------------------------------------------------------------------ reads
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reconstructed ``(keys [B, H, S, D], values [B, H, S, Dv])``; decodes only new blocks."""
        if self.keys is None or self.values is None:
            raise KVShapeError("the cache is empty: nothing to read (append with update_and_fetch first)")
        return self.keys.read(), self.values.read()

    def release_view(self) -> None:
        """Drop both memoized reconstructions (e.g. when attention runs on the stored rows instead)."""
        for stream in self._streams():
            stream.release_view()

    def _streams(self) -> tuple[CodecStream, ...]:
        return tuple(s for s in (self.keys, self.values) if s is not None)

    # ------------------------------------------------------------------ length and edits
    @property
    def offset(self) -> int:
        """Tokens held (``S_total``)."""
        return 0 if self.keys is None else self.keys.seq_len

    def empty(self) -> bool:
        """True when no token is held."""
        return self.offset == 0

    def reset(self) -> None:
        """Forget everything, including the B / H / D / dtype / device fixed by the first update."""
        self.keys = None
        self.values = None

    def archived_blocks(self) -> int:
        """Complete blocks in the archive (the tokens before ``archived_blocks() * block_size``)."""
        return 0 if self.keys is None else self.keys.n_blocks

    def drop_front(self, blocks: int) -> None:
        """Forget the first ``blocks`` archived blocks of keys and values (a sliding window moved
        past them): :attr:`offset` falls by ``blocks * block_size``. ``KVTrimError`` (nothing
        changed) unless ``0 <= blocks <= archived_blocks()``."""
        blocks = check_int("blocks", blocks, low=0, high=self.archived_blocks(), error=KVTrimError)
        for stream in self._streams():
            stream.drop_front(blocks)

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens; a negative value drops ``-max_length`` from the end
        (transformers' convention). No-op when ``max_length >= offset``.

        Exact and repeatable: afterwards :meth:`read` equals the previous read's first tokens bit
        for bit. A cut inside an archived block turns that block's kept tokens (reconstructed) back
        into raw tail tokens; blocks before it are never touched.
        """
        self.plan_crop(max_length)()

    def plan_crop(self, max_length: int) -> Callable[[], None]:
        """Check and prepare :meth:`crop` (decoding the block it cuts into) without changing
        anything; the returned function applies it and cannot fail. Lets a caller editing several
        caches prepare all of them before changing any."""
        n = check_int("max_length", max_length, error=KVTrimError)
        if n < 0:
            n = max(0, self.offset + n)
        if n >= self.offset:
            return _nothing
        streams = self._streams()
        heads = [stream.prepare_crop(n) for stream in streams]  # may decode (allocate): before any change
        if any(head is not None for head in heads):
            self._check_writable("crop inside a block")

        def commit() -> None:
            for stream, head in zip(streams, heads, strict=True):
                stream.commit_crop(n, head)

        return commit

    def is_trimmable(self) -> bool:
        """Always True: :meth:`trim` / :meth:`crop` are supported."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (clamped to :attr:`offset`); returns how many were dropped."""
        dropped = trim_count(n, self.offset)
        if dropped:
            self.crop(self.offset - dropped)
        return dropped

    def reorder(
        self, beam_idx: torch.Tensor | Sequence[int], *, name: str = "beam_idx", allow_mask: bool = False
    ) -> None:
        """Gather every buffer (archive, tail, view) along the batch axis, e.g. for beam search.

        ``beam_idx``: 1-D integer indices into the current batch (any length >= 1; the batch becomes
        it), negative ones counted from the end as in tensor indexing; with ``allow_mask``, also a
        boolean mask over the batch. ``name`` is the argument the caller's error message names.
        A cache that never stored a token has no batch to gather from: ``KVShapeError`` (after
        checking the form of the indices), and it stays empty.
        """
        self.plan_reorder(beam_idx, name=name, allow_mask=allow_mask)()

    def plan_reorder(
        self, beam_idx: torch.Tensor | Sequence[int], *, name: str = "beam_idx", allow_mask: bool = False
    ) -> Callable[[], None]:
        """Check and prepare :meth:`reorder` (the gathered buffers) without changing anything; the
        returned function installs them and cannot fail."""
        if self.keys is None or self.values is None:
            idx = batch_index(name, beam_idx, None, allow_mask=allow_mask)
            raise KVShapeError(
                f"cannot gather batch rows {idx.tolist()} ({name}) from a cache that never stored a token: "
                "it has no batch yet (append first)"
            )
        idx = batch_index(name, beam_idx, self.keys.batch, allow_mask=allow_mask, device=self.keys.device)
        streams = self._streams()
        plans = [stream.prepare_reorder(idx) for stream in streams]  # allocates: before any change

        def commit() -> None:
            for stream, plan in zip(streams, plans, strict=True):
                stream.commit_reorder(plan)

        return commit

    # ------------------------------------------------------------------ bytes
    def storage_bytes(self) -> CodecStorage:
        """Measured bytes, keys + values: ``used`` / ``tail`` / ``allocated`` / ``view`` / ``raw``.

        ``used + tail`` (``.held``) is the compressed representation and equals :attr:`nbytes`;
        ``allocated`` is the reserved archive capacity plus the tail buffers; ``view`` is the
        memoized reconstruction, reported separately.
        """
        total = CodecStorage()
        for stream in self._streams():
            total = total + stream.storage_bytes()
        return total

    @property
    def nbytes(self) -> int:
        """Bytes of the used archive blocks (incl. int8 scales / png anchors) plus the raw tail.

        Spare archive capacity and the memoized view are not counted (see :meth:`storage_bytes`).
        Equals the summed ``.nbytes`` of :attr:`state`.
        """
        return self.storage_bytes().held

    @property
    def raw_nbytes(self) -> int:
        """Bytes an uncompressed cache of the same dtype would hold for the same tokens."""
        return self.storage_bytes().raw

    # ------------------------------------------------------------------ serialization
    @property
    def state(self) -> tuple[torch.Tensor, ...]:
        """``(*key_parts, *key_tail, *value_parts, *value_tail)``: the used archive slices and tails.

        Part order and shapes follow ``codec.part_specs``, then ``codec.tail_coder.part_specs`` (one
        ``tail`` array in the input dtype unless the codec's ``window_bits`` is set; see
        :mod:`flashcodec.stream`). Empty cache: ``()``.
        Copies: writing into them never changes the cache.
        """
        if self.keys is None or self.values is None:
            return ()
        return (*self.keys.state(), *self.values.state())

    @property
    def meta_state(self) -> tuple[str, ...]:
        """Plain ``key=value`` strings: format version, codec config, check_finite, initial_blocks,
        offset, dtype (``None`` for an empty cache).

        :meth:`from_state` checks the arrays against all of it (the offset included), so a state
        paired with another cache's meta_state is refused instead of rebuilt wrong.
        """
        items = {"format": _META_VERSION, **self.codec.config()}
        items.update(check_finite=self.check_finite, initial_blocks=self.initial_blocks, offset=self.offset)
        items["dtype"] = None if self.keys is None else str(self.keys.dtype).removeprefix("torch.")
        return tuple(f"{k}={v}" for k, v in items.items())

    @classmethod
    def from_state(cls, state: Sequence[torch.Tensor], meta_state: Sequence[str]) -> CodecKVCache:
        """Rebuild a cache from :attr:`state` and :attr:`meta_state` (the arrays are copied).

        ``KVConfigError`` for a meta_state that does not parse or names a bad codec; ``KVDataError``
        naming the array for a state that does not fit it (count, shapes, dtypes, devices, the
        recorded offset, non-finite values, scales or codes no codec writes).
        """
        options, offset, dtype = _parse_meta(meta_state)
        cache = cls(**options)
        if isinstance(state, (str, bytes, torch.Tensor)) or not isinstance(state, Sequence):
            raise KVDataError(
                f"state must be a sequence of tensors (a cache's .state); got {type(state).__name__}"
            )
        arrays = tuple(state)
        check_state_layout(
            cache.codec,
            arrays,
            supported_dtypes=SUPPORTED_DTYPES,
            offset=offset,
            check_finite=cache.check_finite,
            dtype=dtype,
        )
        if not arrays:
            return cache
        n_parts = len(cache.codec.stream_state_specs(1))  # the keys' arrays, then the values'
        k_arrays, v_arrays = arrays[:n_parts], arrays[n_parts:]
        dtype = (
            dtype or k_arrays[-1].dtype
        )  # an empty cache's meta records none: the raw tail's (checked above)
        common = dict(dtype=dtype, initial_blocks=cache.initial_blocks)
        cache.keys = CodecStream.from_state(cache.codec, k_arrays, **common)
        cache.values = CodecStream.from_state(cache.codec.value_codec, v_arrays, **common)
        return cache


def _nothing() -> None:
    """The commit of an edit that changes nothing."""


def _check_stored(name: str, codec: BlockCodec, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    """``KVValueError`` when a part about to be stored holds inf / NaN although the input was finite:
    the storage dtype cannot hold the value (jpeg in fp16: a constant block of ``c`` has the DC
    coefficient ``c * sqrt(r)``, which overflows fp16 for ``|c|`` above ~23,170 at ``r = 8``)."""
    for part in parts:
        if not all_finite(part):
            raise KVValueError(
                f"{name}: the {codec.mode} codec's stored {part.dtype} values overflow (a coefficient exceeds "
                f"the largest {part.dtype} value) for this {dtype} input; nothing was stored. Inputs must stay "
                "well inside the dtype's range (jpeg: |x| * sqrt(block_size) <= the largest value), or use "
                "bf16 / fp32 input, quant_bits=8 (fp32 scales) or png"
            )


def _parse_meta(meta_state: Sequence[str]) -> tuple[dict, int, torch.dtype | None]:
    """:attr:`CodecKVCache.meta_state` -> (the constructor's ``codec``, ``check_finite`` and
    ``initial_blocks``; the recorded offset; the recorded dtype, None for an empty cache)."""
    if isinstance(meta_state, (str, bytes)) or not isinstance(meta_state, Sequence):
        raise KVConfigError(f"meta_state must be a sequence of 'key=value' strings; got {meta_state!r:.200}")
    try:
        pairs = [s.split("=", 1) for s in meta_state]
        items = dict(pairs)
    except (TypeError, ValueError, AttributeError) as err:
        raise KVConfigError(f"meta_state must be 'key=value' strings; got {meta_state!r:.200}") from err
    if len(items) != len(pairs):
        raise KVConfigError(f"meta_state names a key twice; got {meta_state!r:.200}")
    version = items.pop("format", None)
    if version != _META_VERSION:
        raise KVConfigError(f"meta_state format must be {_META_VERSION!r}; got {version!r}")
    try:
        flags = {"True": True, "False": False}
        if items.get("check_finite") not in flags:
            raise KVConfigError(f"check_finite must be True or False; got {items.get('check_finite')!r}")
        check_finite = flags[items.pop("check_finite")]
        initial_blocks = check_int("initial_blocks", _literal(items.pop("initial_blocks")), low=1)
        offset = check_int("offset", _literal(items.pop("offset")), low=0)
        name = items.pop("dtype")
        if name != "None" and name not in _DTYPE_BY_NAME:
            raise KVConfigError(f"dtype must be None or one of {tuple(_DTYPE_BY_NAME)}; got {name!r}")
        dtype = _DTYPE_BY_NAME.get(name)
        mode = items.pop("mode")
        codec = make_codec(mode, **{k: _literal(v) for k, v in items.items()})
    except KeyError as err:
        raise KVConfigError(f"meta_state is missing the entry {err}; got {meta_state!r:.200}") from err
    except KVConfigError as err:
        raise KVConfigError(f"meta_state has a bad entry: {err}") from err
    return {"codec": codec, "check_finite": check_finite, "initial_blocks": initial_blocks}, offset, dtype


def _literal(text: str) -> object:
    """A codec option as written by :meth:`BlockCodec.config`: a Python literal, else the string
    itself (dtype names such as ``float64``)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
