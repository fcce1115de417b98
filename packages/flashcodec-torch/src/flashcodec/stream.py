"""One tensor's codec storage (the keys, or the values, of one layer).

Stored layout (read directly by coefficient-domain attention)
------------------------------------------------------------
A stream with batch ``B``, heads ``H``, head dimension ``D``, input dtype ``dt`` and block size
``r`` holds three things:

* **archive**: one preallocated tensor per codec part, ``[B, H, capacity, *part_shape]``; the
  first ``n_blocks`` slots along dim 2 are in use (``archived_parts()`` returns those slices).
  Block ``b`` covers tokens ``b*r .. b*r + r - 1``. ``capacity`` starts at ``initial_blocks``
  (16) on the first archived block and doubles on overflow, but never reserves more than
  ``max_spare_blocks`` (:func:`spare_blocks`: :data:`SPARE_BLOCKS` = 4 at r <= 8, 0 at r = 64)
  blocks beyond those needed (with the defaults that cap sets the capacity: the first block gets
  5 at r = 8): spare capacity is at most 32 tokens' worth of stored rows, less than one attention
  chunk, so resident bytes stay within held bytes + one chunk + the tail buffer. A block is
  written once, in place, and never rewritten (``crop`` only lowers ``n_blocks``; later appends
  reuse the freed slots).

  The parts are the codec's ``part_specs(D)``; ``D/2`` is two int4 codes a byte (uint8):

  ==========================  ===================================================  ======================
  codec                       parts (per block shape)                              dtype
  ==========================  ===================================================  ======================
  jpeg                        ``coeffs [K, D]``                                    ``dt``
  jpeg, ``quant_bits=8``      ``coeffs [K, D]``, ``scales [K, 1]``                 int8, fp32
  jpeg, ``quant_bits=4``      ``coeffs [K, D/2]``, ``scales [K, 1]``               uint8, fp32
  jpeg-mixed                  ``coeffs8 [K8, D]``, ``coeffs4 [K4, D/2]``,          int8, uint8, fp32
                              ``scales [K8 + K4, 1]``
  jpeg-int4z                  ``coeffs [K, D/2]``, ``scales``, ``zeros [K, 1]``    uint8, fp16, fp16
  chan-int4                   ``codes [r, D/2]``, ``scales``, ``zeros [1, D]``     uint8, fp16, fp16
  kivi, keys                  ``codes [r, D or D/2]``, ``scales``, ``zeros         int8 or uint8, fp16,
                              [1, D]``                                             fp16
  kivi, values                ``codes [r, D or D/2]``, ``scales``, ``zeros         int8 or uint8, fp16,
                              [r, 1]``                                             fp16
  png                         ``anchors [D]``, ``deltas [r-1, D]``                 ``dt``, delta dtype
  ==========================  ===================================================  ======================

  The png delta dtype is float64 by default (float32 on request): see ``codecs/png.py``. Other
  registered codecs (``flashcodec.codecs.CODECS``) describe theirs the same way.
  ``stored_rows(dtype)`` gives the dense rows ``[B, H, n_blocks, R, D]`` and
  ``codec.synthesis_matrix()`` the ``A [r, R]`` with ``block = A @ rows``
  (jpeg: ``A = M^T``, rows = coefficients, dequantized; png: ``A`` = lower-triangular ones,
  rows = ``[anchor; deltas]``), hence ``q . K[b*r + p] = (q . rows[b]^T) @ A[p]``.
* **tail**: one buffer per part of the codec's tail coder (``codec.tail_coder``,
  :mod:`flashcodec.codecs.tail`), ``[B, H, slots, *part_shape]``; their first ``tail_len < r + w``
  tokens are the tokens after the last complete block (``tail()`` decodes them). Raw (the default):
  one buffer in ``dt``, the tokens bit for bit; ``window_bits=8``: uint8 codes with an fp32 scale
  and zero point per token. ``w`` is the codec's ``raw_window`` (0 for most codecs): a block is
  coded only once ``w`` newer tokens follow it, so the newest ``w`` tokens (up to ``w + r - 1``)
  are never block-coded, as in KIVI's residual window. ``slots`` follows the tail
  (:func:`tail_slots`: ``r + w`` less as many whole :data:`TAIL_STEP`-token steps as the tail
  leaves empty): with a 64-token block behind a 64-token window the tail swings between 64 and
  127 tokens, and a fixed ``r + w`` buffer would keep a quarter of it empty on average. A tail
  that never leaves a whole step empty (``r + w <= 16``, or a window of 96 behind 8-token blocks:
  96 to 103 tokens in 104 slots) keeps one buffer, written in place, as a fixed size would.
* **view** (memoized reconstruction): ``[B, H, view_capacity, D]`` in ``dt``, or None. Its first
  ``view_blocks * r`` tokens are decoded blocks; ``read()`` decodes only blocks archived since the
  last read (one batched decode), copies the tail behind them and returns the first ``seq_len``
  tokens. ``release_view()`` drops it; the next ``read()`` rebuilds it.

* **sink** (only for a codec with ``sink_tokens = k > 0``): the first ``k`` tokens of the
  sequence, stored by the tail coder (``[B, H, k, *part_shape]`` per part), kept from the moment
  block 0 is archived (before that they are tail tokens) until a ``crop`` drops block 0. They
  replace block 0's first ``k`` rows wherever tokens are read (``read()``, a crop's re-stored
  head, :func:`flashcodec.attention.coded_rows`): an attention sink held at the tail's precision
  for a few bytes. Block 0 still codes all its ``r`` tokens (so the codec's parts keep one shape).

Token ``p`` of the sequence is the sink's token ``p`` if ``p < k`` and a block is archived, else
archived block ``p // r`` row ``p % r`` if ``p < n_blocks * r``, else tail token ``p - n_blocks * r``.

The stream trusts its inputs: :class:`flashcodec.CodecKVCache` validates every call first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvspec import KVConfigError

from .codecs.base import BlockCodec
from .storage import CodecStorage
from .validate import check_int

__all__ = [
    "AppendPlan",
    "CodecStream",
    "ReorderPlan",
    "SPARE_BLOCKS",
    "SPARE_TOKENS",
    "TAIL_STEP",
    "spare_blocks",
    "tail_slots",
]

#: most archive blocks reserved beyond those in use (well under one attention chunk,
#: :data:`flashcodec.attention.CHUNK_BLOCKS`): the archive grows by this many blocks beyond what
#: it needs. Each regrowth copies the archive, so decoding pays one archive copy per
#: ``SPARE_BLOCKS * r`` tokens (32 at r = 8), about 1/32 of what attention reads in those steps;
#: in exchange the reserve averages 16 tokens' codes (2 blocks), where 16 blocks (the earlier
#: value) averaged 64: against a 4-bit cache of a few thousand tokens that difference is a few
#: per cent of its bytes
SPARE_BLOCKS = 4
#: and at most this many tokens' worth of blocks (:func:`spare_blocks`)
SPARE_TOKENS = 32


def spare_blocks(block_size: int) -> int:
    """The default reserve in blocks: :data:`SPARE_BLOCKS`, but no more than :data:`SPARE_TOKENS`
    tokens (4 at r = 8; 0 at r = 64, where one spare block alone would be 3% of a 2,048-token
    archive, and a regrowth per 64-token block costs less than one per 32 tokens at r = 8)."""
    return min(SPARE_BLOCKS, SPARE_TOKENS // block_size)


#: the tail buffers grow in steps of this many tokens (:func:`tail_slots`): a regrowth copies the
#: tail (at most ``r + raw_window`` tokens) at most once per 16 decode steps, and the buffer keeps
#: at most 15 empty slots beyond what a fixed ``r + raw_window`` buffer would
TAIL_STEP = 16

#: the attributes of a stream an append may change: saved before it, put back by its undo
_APPEND_STATE = (
    "_archive",
    "_tail",
    "_sink",
    "n_blocks",
    "tail_len",
    "_view",
    "view_blocks",
    "_view_version",
)


def tail_slots(tokens: int, full: int) -> int:
    """Tail buffer slots for ``0 <= tokens < full`` tail tokens, ``full`` being ``r + raw_window``:
    ``full`` less every whole :data:`TAIL_STEP` of slots the tail leaves empty. Counting the steps
    down from ``full`` (not up from 0) keeps a tail that always fills all but a few slots (8-token
    blocks behind a 96-token window: 96 to 103 tokens) in one buffer of ``full`` slots, so only
    tails that swing by a step or more (64-token blocks: 64 to 127 tokens) are ever reallocated."""
    return full - (full - tokens) // TAIL_STEP * TAIL_STEP


@dataclass(frozen=True)
class AppendPlan:
    """What :meth:`CodecStream.prepare_append` computed: the input (canonical), the tail parts
    to write from tail slot ``rest_at`` (when no block completes: the input's, after the tail
    tokens; when blocks complete: the whole new tail, from slot 0), the completed blocks' encoded
    parts, the grown archive (None when the old one has room) and new tail buffers already
    holding the whole new tail (None when ``rest`` is written into the old ones, which have room),
    and the sink's parts when this append archives block 0 of a codec with ``sink_tokens`` (else None)."""

    x: torch.Tensor
    rest: tuple[torch.Tensor, ...]
    rest_at: int
    parts: tuple[torch.Tensor, ...]
    archive: tuple[torch.Tensor, ...] | None
    tail: tuple[torch.Tensor, ...] | None = None
    sink: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class ReorderPlan:
    """The buffers :meth:`CodecStream.prepare_reorder` gathered (view None: there was none) and
    whether the view was trustworthy (when not, its blocks are decoded again on the next read)."""

    archive: tuple[torch.Tensor, ...]
    tail: tuple[torch.Tensor, ...]
    view: torch.Tensor | None
    view_trusted: bool
    sink: tuple[torch.Tensor, ...] = ()


def _version(t: torch.Tensor) -> int | None:
    """``t``'s in-place write counter; None for inference-mode tensors, which keep none."""
    try:
        return t._version
    except RuntimeError:
        return None


class CodecStream:
    """Raw tail + capacity-doubled archive + memoized view for one ``[B, H, S, D]`` tensor.

    Args:
        codec: the block codec (its ``block_size`` is ``r``).
        batch, heads, dim: ``B``, ``H``, ``D`` of every tensor appended.
        dtype: the input dtype (fp16, bf16 or fp32); tail and view use it.
        device: where every buffer lives.
        initial_blocks: archive capacity (in blocks) allocated with the first complete block, at
            most ``max_spare_blocks`` more than it needs.
        max_spare_blocks: most blocks reserved beyond those in use when the archive grows; None
            (the default): :func:`spare_blocks` of the codec's block size.
    """

    def __init__(
        self,
        codec: BlockCodec,
        batch: int,
        heads: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        initial_blocks: int = 16,
        max_spare_blocks: int | None = None,
    ):
        if not isinstance(codec, BlockCodec):
            raise KVConfigError(f"codec must be a codec object such as JPEGCodec(...); got {codec!r}")
        batch, heads, dim = (
            check_int(n, v, low=1) for n, v in (("batch", batch), ("heads", heads), ("dim", dim))
        )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise KVConfigError(f"dtype must be a floating torch.dtype; got {dtype!r}")
        self.codec = codec
        self.batch, self.heads, self.dim = batch, heads, dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.initial_blocks = check_int("initial_blocks", initial_blocks, low=1)
        if max_spare_blocks is None:
            max_spare_blocks = spare_blocks(codec.block_size)
        self.max_spare_blocks = check_int("max_spare_blocks", max_spare_blocks, low=0)
        self._archive: tuple[torch.Tensor, ...] = ()
        self.n_blocks = 0
        # the tail holds fewer than r + raw_window tokens, stored by the codec's tail coder in
        # buffers that follow its length (tail_slots; sized for an empty tail here)
        self._tail = self._tail_buffers(0)
        self.tail_len = 0
        # the first sink_tokens tokens apart from block 0 (empty until block 0 is archived)
        self._sink = self._no_sink()
        self._view: torch.Tensor | None = None
        self._view_version: int | None = None  # the view's version counter after this stream's last write
        self.view_blocks = 0

    # ------------------------------------------------------------------ copying
    def __getstate__(self) -> dict:
        # a copy (deepcopy, pickle) gets a view tensor with a fresh version counter: carry whether
        # the view was trustworthy instead of the counter value
        state = dict(self.__dict__)
        state["_view_version"] = self._view_is_trusted()
        return state

    def __setstate__(self, state: dict) -> None:
        trusted = state.pop("_view_version")
        self.__dict__.update(state)
        self._view_version = _version(self._view) if self._view is not None and trusted else None
        if not trusted:
            self.view_blocks = 0

    # ------------------------------------------------------------------ read-only description
    @property
    def block_size(self) -> int:
        return self.codec.block_size

    @property
    def raw_window(self) -> int:
        """Newest tokens always kept raw (the codec's ``raw_window``)."""
        return self.codec.raw_window

    @property
    def seq_len(self) -> int:
        """Tokens held: ``n_blocks * r + tail_len``."""
        return self.n_blocks * self.codec.block_size + self.tail_len

    @property
    def capacity(self) -> int:
        """Archive capacity in blocks (0 before the first block is archived)."""
        return self._archive[0].shape[2] if self._archive else 0

    @property
    def archive(self) -> tuple[torch.Tensor, ...]:
        """The archive buffers at full capacity, ``[B, H, capacity, *part_shape]`` each (empty tuple before use)."""
        return self._archive

    def buffers_are_inference(self) -> bool:
        """Whether any buffer written in place (archive, tail) was made under ``torch.inference_mode``
        (then torch lets it change only inside it)."""
        return any(b.is_inference() for b in (*self._archive, *self._tail))

    @property
    def has_view(self) -> bool:
        """Whether a memoized reconstruction buffer is held."""
        return self._view is not None

    def archived_parts(self) -> tuple[torch.Tensor, ...]:
        """The used archive, ``[B, H, n_blocks, *part_shape]`` per part (views, no copy)."""
        if not self._archive:
            return tuple(
                torch.empty(
                    self.batch, self.heads, 0, *spec.shape, dtype=spec.dtype or self.dtype, device=self.device
                )
                for spec in self.codec.part_specs(self.dim)
            )
        return tuple(buf[:, :, : self.n_blocks] for buf in self._archive)

    def stored_rows(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense rows ``[B, H, n_blocks, R, D]`` in ``dtype`` with ``block = codec.synthesis_matrix() @ rows``."""
        return self.codec.stored_rows(self.archived_parts(), dtype)

    def tail(self) -> torch.Tensor:
        """The tail tokens ``[B, H, tail_len, D]`` in the stream dtype (raw tail: a view; int8: decoded)."""
        return self.codec.tail_coder.decode(self.tail_parts(0, self.tail_len), self.dtype)

    def tail_parts(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Tail slots ``start .. stop-1`` as stored (views, one per tail part)."""
        return tuple(buf[:, :, start:stop] for buf in self._tail)

    @property
    def sink_len(self) -> int:
        """Tokens the sink holds: the codec's ``sink_tokens`` once a block is archived, else 0."""
        return self._sink[0].shape[2] if self._sink else 0

    def sink_parts(self) -> tuple[torch.Tensor, ...]:
        """The sink as stored (one array per part of :meth:`~flashcodec.codecs.BlockCodec.sink_specs`;
        the arrays themselves, ``[B, H, sink_len, *part_shape]``): empty tuple without a sink."""
        return self._sink

    def sink(self) -> torch.Tensor:
        """The sink's tokens ``[B, H, sink_len, D]`` in the stream dtype (``sink_len`` may be 0)."""
        if not self._sink:
            return torch.empty(self.batch, self.heads, 0, self.dim, dtype=self.dtype, device=self.device)
        return self.codec.tail_coder.decode(self._sink, self.dtype)

    def _no_sink(self) -> tuple[torch.Tensor, ...]:
        """Empty sink arrays (``[B, H, 0, ...]``), or ``()`` for a codec without a sink."""
        return tuple(
            torch.zeros(
                self.batch, self.heads, 0, *spec.shape, dtype=spec.dtype or self.dtype, device=self.device
            )
            for spec in self.codec.sink_specs(self.dim)
        )

    def _decoded_blocks(self, start: int, stop: int) -> torch.Tensor:
        """Archived blocks ``start .. stop-1`` decoded, ``[B, H, (stop-start) * r, D]`` in the stream
        dtype, block 0's first tokens taken from the sink."""
        out = self.codec.decode(tuple(buf[:, :, start:stop] for buf in self._archive), self.dtype)
        k = self.sink_len
        if start == 0 and k and stop > start:
            out[:, :, :k] = self.sink()
        return out

    @property
    def tail_capacity(self) -> int:
        """Slots of the tail buffers (:func:`tail_slots` of a recent tail length, >= ``tail_len``)."""
        return self._tail[0].shape[2]

    def _write_tail(self, at: int, parts: tuple[torch.Tensor, ...]) -> None:
        for buf, part in zip(self._tail, parts, strict=True):
            buf[:, :, at : at + part.shape[2]].copy_(part)

    def _tail_buffers(self, tokens: int, *contents: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """New tail buffers with :func:`tail_slots` of ``tokens`` slots holding ``contents`` (tail
        parts, written one after another from slot 0); the slots past them are zero."""
        slots = tail_slots(tokens, self.codec.block_size + self.raw_window)
        bufs = tuple(
            torch.zeros(
                self.batch, self.heads, slots, *spec.shape, dtype=spec.dtype or self.dtype, device=self.device
            )
            for spec in self.codec.tail_coder.part_specs(self.dim)
        )
        at = 0
        for parts in contents:
            for buf, part in zip(bufs, parts, strict=True):
                buf[:, :, at : at + part.shape[2]].copy_(part)
            at += parts[0].shape[2]
        return bufs

    # ------------------------------------------------------------------ writes
    # Every edit is two steps, so a cache can change its key and value streams together: ``prepare_*``
    # computes and allocates everything (it may raise, e.g. out of memory) without changing the
    # stream; ``commit_*`` only assigns and copies into buffers that already exist.
    @torch.no_grad()
    def prepare_append(self, x: torch.Tensor) -> AppendPlan:
        """Encode the blocks ``x [B, H, s, D]`` completes and allocate any archive growth; changes nothing."""
        x = self.codec.canonical(x)  # png: -0.0 -> +0.0, so the raw tail equals what the archive returns
        r, t, s, w = self.codec.block_size, self.tail_len, x.shape[2], self.raw_window
        # blocks complete only from raw tokens older than the newest w (the raw window)
        n_new = max(0, (t + s - w) // r)
        coder = self.codec.tail_coder
        if n_new == 0:
            rest = coder.encode(x)
            # past the buffers' slots: new ones holding the old tail and the new tokens
            tail = (
                None
                if t + s <= self.tail_capacity
                else self._tail_buffers(t + s, self.tail_parts(0, t), rest)
            )
            return AppendPlan(x=x, rest=rest, rest_at=t, parts=(), archive=None, tail=tail)
        cut = n_new * r
        if cut >= t:  # the blocks take the whole tail and the first cut - t tokens of x
            seq = torch.cat([self.tail(), x[:, :, : cut - t]], dim=2) if t else x[:, :, :cut]
            rest = coder.encode(x[:, :, cut - t :])
        else:  # a window: the blocks are the oldest tail tokens, the rest of the tail moves forward
            seq = coder.decode(self.tail_parts(0, cut), self.dtype)
            rest = tuple(
                torch.cat([old, new], dim=2)
                for old, new in zip(self.tail_parts(cut, t), coder.encode(x), strict=True)
            )
        parts = self.codec.encode_blocks(seq, self.n_blocks)  # block n_blocks is the first of seq
        grown = self._grown_archive(self.n_blocks + n_new)
        # the tail got shorter: new buffers sized to it when it frees a step of slots (the old ones
        # stay intact for the undo), else the new tail is written over the old one from slot 0
        n_rest = rest[0].shape[2]
        tail = None if tail_slots(n_rest, r + w) == self.tail_capacity else self._tail_buffers(n_rest, rest)
        sink = None
        k = self.codec.sink_tokens
        if k and self.n_blocks == 0:
            # block 0 leaves the tail: its first k tokens stay as the tail stored them (copies of
            # the stored parts, so reading them after the archive changes nothing), else coded now
            sink = tuple(p.clone() for p in self.tail_parts(0, k)) if t >= k else coder.encode(seq[:, :, :k])
        return AppendPlan(x=x, rest=rest, rest_at=0, parts=parts, archive=grown, tail=tail, sink=sink)

    @torch.no_grad()
    def commit_append(self, plan: AppendPlan) -> Callable[[], None]:
        """Apply :meth:`prepare_append`'s plan (made on this stream, unchanged since).

        Returns an undo: called before any other change to the stream (a failed read right
        after, in :meth:`flashcodec.CodecKVCache.update_and_fetch`), it puts the stream back
        exactly as it was. It keeps the previous archive and tail buffers and, when blocks
        complete into the same tail buffers, a copy of the tail tokens the commit overwrites.
        """
        undo = self._undo_append(plan)
        if plan.parts:
            if plan.archive is not None:
                self._archive = plan.archive
            start, n_new = self.n_blocks, plan.parts[0].shape[2]
            for buf, part in zip(self._archive, plan.parts, strict=True):
                buf[:, :, start : start + n_new].copy_(part)
            self.n_blocks = start + n_new
        if plan.sink is not None:
            self._sink = plan.sink
        if plan.tail is not None:
            self._tail = plan.tail
        else:
            self._write_tail(plan.rest_at, plan.rest)
        self.tail_len = plan.rest_at + plan.rest[0].shape[2]
        return undo

    def _undo_append(self, plan: AppendPlan) -> Callable[[], None]:
        # A commit only writes archive slots past n_blocks (or into new buffers), tail slots past
        # tail_len when no block completes, the whole tail when blocks complete into the same
        # buffers, or installs new tail buffers: restoring the counts, the buffer references and
        # that tail copy restores the stream. The view's trusted part (its first view_blocks
        # blocks) is never written by a read that follows.
        saved = tuple(getattr(self, name) for name in _APPEND_STATE)
        trusted = self._view_is_trusted()
        overwritten = (
            tuple(p.clone() for p in self.tail_parts(0, self.tail_len))
            if plan.parts and plan.tail is None and self.tail_len
            else None
        )

        def undo() -> None:
            view = self._view
            for name, value in zip(_APPEND_STATE, saved, strict=True):
                setattr(self, name, value)
            if overwritten is not None:
                self._write_tail(0, overwritten)
            if trusted and self._view is view and view is not None:
                self._view_version = _version(view)  # only written past the trusted blocks since

        return undo

    def append(self, x: torch.Tensor) -> None:
        """Append ``x [B, H, s, D]`` (validated by the caller): complete blocks are archived in one encode."""
        self.commit_append(self.prepare_append(x))

    def _grown_archive(self, blocks: int) -> tuple[torch.Tensor, ...] | None:
        """New archive buffers holding the used blocks, with room for ``blocks``; None when they fit."""
        cap = self.capacity
        if blocks <= cap:
            return None
        new_cap = max(cap, self.initial_blocks)
        while new_cap < blocks:
            new_cap *= 2
        new_cap = min(new_cap, blocks + self.max_spare_blocks)
        new = []
        for i, spec in enumerate(self.codec.part_specs(self.dim)):
            buf = torch.zeros(
                self.batch,
                self.heads,
                new_cap,
                *spec.shape,
                dtype=spec.dtype or self.dtype,
                device=self.device,
            )
            if self.n_blocks:
                buf[:, :, : self.n_blocks].copy_(self._archive[i][:, :, : self.n_blocks])
            new.append(buf)
        return tuple(new)

    def _ensure_capacity(self, blocks: int) -> None:
        grown = self._grown_archive(blocks)
        if grown is not None:
            self._archive = grown

    # ------------------------------------------------------------------ reads
    def _view_is_trusted(self) -> bool:
        """Whether the memoized view still holds what this stream wrote into it.

        :meth:`read` hands out a view of the buffer; an in-place write through it (or any view of
        it) bumps the tensor's version counter, and the stream then rebuilds the decoded part from
        the archive instead of serving the caller's edit as cache content. Writes that bypass the
        version counter (``.numpy()``, ``.data``) cannot be seen: clone before editing that way.
        """
        return self._view is not None and _version(self._view) == self._view_version

    @torch.no_grad()
    def read(self) -> torch.Tensor:
        """The reconstructed sequence ``[B, H, seq_len, D]`` in the input dtype.

        Decodes only the blocks archived since the previous read (one batched decode), then
        copies the raw tail behind them. Returns a view into the memoized buffer, valid until the
        next call that changes the stream (clone it to keep it). Writing into it never changes the
        cache: the next read notices the write and decodes the archive again.
        """
        r, total = self.codec.block_size, self.seq_len
        if self._view is not None and self._view.is_inference() and not torch.is_inference_mode_enabled():
            self.release_view()  # built under inference_mode, read outside it: torch forbids writing it
        if self._view is not None and not self._view_is_trusted():
            self.view_blocks = 0  # a caller wrote into a returned view: decode everything again
        self._ensure_view(total)
        assert self._view is not None
        a, b = self.view_blocks, self.n_blocks
        if a < b:
            self._view[:, :, a * r : b * r].copy_(self._decoded_blocks(a, b))
            self.view_blocks = b
        if self.tail_len:
            self._view[:, :, b * r : total].copy_(self.tail())
        self._view_version = _version(self._view)
        return self._view[:, :, :total]

    def _ensure_view(self, tokens: int) -> None:
        cap = 0 if self._view is None else self._view.shape[2]
        if self._view is not None and tokens <= cap:
            return
        new_cap = max(cap, self.initial_blocks * self.codec.block_size, 1)
        while new_cap < tokens:
            new_cap *= 2
        view = torch.empty(self.batch, self.heads, new_cap, self.dim, dtype=self.dtype, device=self.device)
        done = self.view_blocks * self.codec.block_size
        if self._view is not None and done:
            view[:, :, :done].copy_(self._view[:, :, :done])
        self._view = view

    def release_view(self) -> None:
        """Drop the memoized reconstruction (its memory); the next :meth:`read` rebuilds it."""
        self._view = None
        self.view_blocks = 0

    # ------------------------------------------------------------------ edits
    @torch.no_grad()
    def prepare_crop(self, n: int) -> tuple[torch.Tensor, ...] | None:
        """New tail buffers holding the reconstructed first ``n % r`` tokens of the block ``crop(n)``
        cuts into (None when the cut falls on a block boundary or inside the tail); changes nothing."""
        r = self.codec.block_size
        keep_blocks, rem = divmod(n, r)
        if keep_blocks >= self.n_blocks or not rem:
            return None
        if self._view_is_trusted() and self.view_blocks > keep_blocks:
            assert self._view is not None
            head = self._view[:, :, keep_blocks * r : keep_blocks * r + rem].clone()
        else:
            head = self._decoded_blocks(keep_blocks, keep_blocks + 1)[:, :, :rem]
        return self._tail_buffers(rem, self.codec.tail_coder.encode(head))

    @torch.no_grad()
    def commit_crop(self, n: int, head: tuple[torch.Tensor, ...] | None) -> None:
        """Keep the first ``n`` tokens, ``head`` being :meth:`prepare_crop`'s result for the same ``n``."""
        r = self.codec.block_size
        keep_blocks, rem = divmod(n, r)
        if keep_blocks >= self.n_blocks:
            self.tail_len = n - self.n_blocks * r
            return
        if head is not None:
            self._tail = head
        self.tail_len = rem
        self.n_blocks = keep_blocks
        self.view_blocks = min(self.view_blocks, keep_blocks)
        if keep_blocks == 0:  # block 0 is gone: its first tokens are tail tokens again
            self._sink = self._no_sink()

    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens (``0 <= n <= seq_len``, validated by the caller).

        Cutting inside an archived block moves that block's first ``n % r`` *reconstructed* tokens
        (taken from the memoized view when it has them, so the result equals the previous read's
        prefix bit for bit) back to the raw tail and forgets the block. Blocks before it are untouched.
        """
        self.commit_crop(n, self.prepare_crop(n))

    @torch.no_grad()
    def drop_front(self, blocks: int) -> None:
        """Forget the first ``blocks`` archived blocks (``0 <= blocks <= n_blocks``, validated by the
        caller): a sliding window has moved past them. The kept blocks move to the front of new
        buffers of exactly their size, leaving the spare capacity behind (written under the caller's
        grad mode, never into inference tensors); the sink and the view go with block 0."""
        if blocks <= 0:
            return
        self._archive = tuple(buf[:, :, blocks : self.n_blocks].clone() for buf in self._archive)
        self.n_blocks -= blocks
        self._sink = self._no_sink()
        self.release_view()

    @torch.no_grad()
    def prepare_reorder(self, index: torch.Tensor) -> ReorderPlan:
        """Every buffer gathered along the batch axis by ``index`` (int64 ``[B_new]`` on ``device``)."""
        return ReorderPlan(
            archive=tuple(buf.index_select(0, index) for buf in self._archive),
            tail=tuple(buf.index_select(0, index) for buf in self._tail),
            view=None if self._view is None else self._view.index_select(0, index),
            view_trusted=self._view_is_trusted(),
            sink=tuple(buf.index_select(0, index) for buf in self._sink),
        )

    def commit_reorder(self, plan: ReorderPlan) -> None:
        """Install :meth:`prepare_reorder`'s buffers."""
        self._archive, self._tail, self._sink = plan.archive, plan.tail, plan.sink
        self._view = plan.view
        if not plan.view_trusted:
            self.view_blocks = 0  # a caller wrote into it: the next read decodes every block again
        self._view_version = None if plan.view is None else _version(plan.view)
        self.batch = plan.tail[0].shape[0]

    def reorder(self, index: torch.Tensor) -> None:
        """Gather every buffer along the batch axis (beam search); ``index`` int64 ``[B_new]`` on ``device``."""
        self.commit_reorder(self.prepare_reorder(index))

    # ------------------------------------------------------------------ bytes and serialization
    def storage_bytes(self) -> CodecStorage:
        """Bytes measured from the tensors held (see :class:`CodecStorage` for what each field counts)."""
        itemsize = self.dtype.itemsize
        sink = sum(p.nbytes for p in self._sink)  # held with the archive: block 0's first tokens
        return CodecStorage(
            used=sum(p.nbytes for p in self.archived_parts()) + sink,
            tail=sum(p.nbytes for p in self.tail_parts(0, self.tail_len)),
            allocated=sum(b.nbytes for b in (*self._archive, *self._tail)) + sink,
            view=0 if self._view is None else self._view.nbytes,
            raw=self.batch * self.heads * self.seq_len * self.dim * itemsize,
        )

    def state(self) -> tuple[torch.Tensor, ...]:
        """``(*archived_parts(), *sink_parts(), *tail parts)`` as copies (the codec's
        ``stream_state_specs``): exactly the bytes of :meth:`storage_bytes` ``.held``.

        Copies, so that writing into them never changes the stream (a serialization path, not a hot one).
        """
        return tuple(
            t.clone() for t in (*self.archived_parts(), *self._sink, *self.tail_parts(0, self.tail_len))
        )

    @classmethod
    def from_state(
        cls,
        codec: BlockCodec,
        arrays: tuple[torch.Tensor, ...],
        dtype: torch.dtype,
        *,
        initial_blocks: int = 16,
    ) -> CodecStream:
        """Rebuild from :meth:`state` of a stream of ``dtype`` (shapes and dtypes checked by the
        caller). Copies the arrays."""
        n_parts, n_sink = len(codec.part_specs(1)), len(codec.sink_specs(1))
        parts, sink, tail = arrays[:n_parts], arrays[n_parts : n_parts + n_sink], arrays[n_parts + n_sink :]
        b, h, _, d = tail[0].shape
        stream = cls(codec, b, h, d, dtype, tail[0].device, initial_blocks=initial_blocks)
        n = parts[0].shape[2]
        if n:
            stream._ensure_capacity(n)
            for buf, part in zip(stream._archive, parts, strict=True):
                buf[:, :, :n].copy_(part)
            stream.n_blocks = n
        if sink and sink[0].shape[2]:
            stream._sink = tuple(p.clone() for p in sink)
        stream._tail = stream._tail_buffers(tail[0].shape[2], tail)
        stream.tail_len = tail[0].shape[2]
        return stream
