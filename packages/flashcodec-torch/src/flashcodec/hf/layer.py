"""FlashCodecLayer: one attention layer's cache for transformers, backed by a CodecKVCache.

transformers 5.x keeps one ``CacheLayerMixin`` per model layer; attention calls
``cache.update(k, v, layer_idx)`` and attends over what comes back. This layer stores the new
``k``/``v`` block-coded (:class:`flashcodec.CodecKVCache`) and returns the memoized reconstruction,
so the write and the read meet at ``update`` and the model itself is not touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from kvspec import KVConfigError, KVShapeError, KVTrimError
from transformers.cache_utils import CacheLayerMixin

from ..cache import CodecKVCache
from ..storage import CodecStorage
from ..validate import batch_index, check_int
from .codes_step import codes_step_active, tag_step

__all__ = ["FlashCodecLayer"]


def _nothing() -> None:
    """The commit of an edit that changes nothing."""


class FlashCodecLayer(CacheLayerMixin):
    """A transformers cache layer that keeps its keys and values block-coded.

    Args: the :class:`flashcodec.CodecKVCache` arguments (``codec=`` or the keyword form
    ``mode``, ``block_size``, ``keep_freqs``, ``keep_ratio``, ``quant_bits``, ``delta_dtype``;
    and ``check_finite``, ``initial_blocks``), validated here (``KVConfigError``). The codec is
    ``layer.codec_cache.codec``.

    ``step_raw`` (default True): a multi-token step (a prefill, a chunk of one, a verification;
    any step but one token on a filled layer) attends its own ``s`` tokens as given and the earlier
    tokens as stored, as transformers' ``QuantizedCache`` does; False: on the stored form of all.

    Shapes: ``update`` takes ``key_states [B, H, s, D]`` and ``value_states [B, H, s, Dv]`` and
    returns the whole sequence ``[B, H, S, D]`` / ``[B, H, S, Dv]`` in the input dtype (archived
    blocks reconstructed, the newest tokens as the codec's tail holds them; with ``step_raw`` the
    step's own tokens as given). ``keys`` / ``values`` are the stored form's latest view (``None``
    before the first update); they are views of memoized buffers, valid until the next call that
    changes the layer.

    Not supported: offloading (the compressed archive is the memory saving) and ``torch.compile``
    (the archive grows; ``is_compileable`` is False so ``generate`` never compiles around it).
    """

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, *, step_raw: bool = True, **cache_options: Any):
        super().__init__()
        if not isinstance(step_raw, bool):
            raise KVConfigError(f"step_raw must be True or False; got {step_raw!r}")
        self.codec_cache = CodecKVCache(**cache_options)
        #: whether a multi-token step attends its own tokens as given (see :meth:`update`)
        self.step_raw = step_raw
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None

    def __repr__(self) -> str:
        return f"FlashCodecLayer({self.codec_cache.codec!r}, seq_len={self.get_seq_length()})"

    # ------------------------------------------------------------------ writes and reads
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Record device and dtype; buffers are allocated by the first non-empty update."""
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states [B, H, s, D]`` / ``value_states [B, H, s, Dv]``; return the full views
        (with :attr:`step_raw`, a multi-token step's own tokens as given).

        Complete blocks are encoded once and archived; reads decode only blocks not decoded before.
        During a forward on the codes (:mod:`flashcodec.hf.codes_step`) nothing is read: the
        step's own tensors come back, tagged for the attention function.
        A rejected input (kvspec error) leaves the layer as it was, a fresh layer uninitialized.
        """
        if isinstance(key_states, torch.Tensor) and key_states.dim() == 4 and key_states.shape[-2] == 0:
            # nothing to store; still checked, so a fresh layer never records a bad dtype or shape
            self.codec_cache.check_input(
                key_states, value_states, fresh=self.codec_cache.keys is None, allow_empty=True
            )
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            return self.keys, self.values
        if codes_step_active():
            # attention on the codes (hf.codec_attention): store without reading anything back
            self.codec_cache.append(key_states, value_states)  # validates first
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.release_view()  # a view some earlier call built (a crop, a materialized step)
            return tag_step(self, key_states, value_states)
        before = self.codec_cache.offset
        keys, values = self.codec_cache.update_and_fetch(key_states, value_states)  # validates first
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = keys, values
        if self.step_raw and (key_states.shape[-2] > 1 or before == 0):
            # the step's own tokens as given, the earlier ones as stored: the codec's error on
            # these tokens would otherwise reach every later layer's keys and values through
            # this layer's output (a copy, so the memoized view keeps the stored form)
            if before == 0:
                return key_states, value_states
            return (
                torch.cat([keys[:, :, :before], key_states], dim=2),
                torch.cat([values[:, :, :before], value_states], dim=2),
            )
        return self.keys, self.values

    def release_view(self) -> None:
        """Drop the memoized ``[B, H, S, D]`` reconstruction and this layer's references to it."""
        self.codec_cache.release_view()
        if isinstance(self.keys, torch.Tensor) and isinstance(self.values, torch.Tensor):
            # fresh empty tensors: even a zero-length slice of the view would keep its storage alive
            b, h, _, d = self.keys.shape
            self.keys = self.keys.new_empty((b, h, 0, d))
            self.values = self.values.new_empty((b, h, 0, self.values.shape[-1]))

    def _refresh(self) -> None:
        """Point ``keys`` / ``values`` at the current reconstruction after an edit.

        Only a layer that keeps a view reads again: on the materialization-free path (no view held)
        a crop or a beam reorder must not rebuild the whole history; ``keys`` / ``values`` are then
        empty ``[B, H, 0, D]`` tensors, as that path leaves them after every step.
        """
        cc = self.codec_cache
        if cc.keys is None or cc.values is None:
            self.keys = self.values = None
        elif cc.keys.has_view:
            self.keys, self.values = cc.read()
        else:
            ks, vs = cc.keys, cc.values
            self.keys = torch.empty(ks.batch, ks.heads, 0, ks.dim, dtype=ks.dtype, device=ks.device)
            self.values = torch.empty(vs.batch, vs.heads, 0, vs.dim, dtype=vs.dtype, device=vs.device)

    # ------------------------------------------------------------------ lengths and masks
    def get_seq_length(self) -> int:
        """Tokens held."""
        return self.codec_cache.offset

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the mask of a query of ``query_length`` new tokens."""
        return self.codec_cache.offset + check_int("query_length", query_length, low=0, error=KVShapeError), 0

    def get_max_length(self) -> int:
        """-1: the layer grows without bound."""
        return -1

    # ------------------------------------------------------------------ edits
    def reset(self) -> None:
        """Forget every token (and the B / H / D / dtype fixed by the first update)."""
        self.codec_cache.reset()
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)`` drops the last ``n`` tokens (transformers 5.x); ``crop(0)`` does nothing.

        A positive value is the older absolute form: keep the first ``tokens_to_remove`` tokens.
        Exact: the kept prefix reads back bit for bit as before.
        """
        self.plan_crop(tokens_to_remove)()

    def plan_crop(self, tokens_to_remove: int) -> Callable[[], None]:
        """Check and prepare :meth:`crop` without changing the layer; the returned function applies it."""
        n = check_int("max_length", tokens_to_remove, error=KVTrimError)
        if n == 0:
            return _nothing
        cc = self.codec_cache
        return self._then_refresh(cc.plan_crop(n if n > 0 else max(0, cc.offset + n)))

    def _then_refresh(self, commit: Callable[[], None]) -> Callable[[], None]:
        def apply() -> None:
            commit()
            self._refresh()  # reads the gathered / cropped view again: copies, no decode

        return apply

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Gather the batch rows ``beam_idx`` (1-D integers ``[B_new]``, negative ones counted from
        the end) of every buffer, for beam search."""
        self.plan_gather(beam_idx, "beam_idx", allow_mask=False)()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times (an integer >= 1), in place (``[B, ...]`` -> ``[B * repeats, ...]``)."""
        self.plan_repeat(repeats)()

    def plan_repeat(self, repeats: int) -> Callable[[], None]:
        """Check and prepare :meth:`batch_repeat_interleave`; the returned function applies it."""
        repeats = check_int("repeats", repeats, low=1, error=KVShapeError)
        if not self.codec_cache.offset or repeats == 1:
            return _nothing
        batch = self.codec_cache.keys.batch
        return self.plan_gather(torch.arange(batch).repeat_interleave(repeats), "repeats", allow_mask=False)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices``: integer indices (negative ones counted from the
        end, as ``DynamicCache`` indexes) or a boolean mask over ``B``."""
        self.plan_gather(indices, "indices", allow_mask=True)()

    def plan_gather(self, indices: object, name: str, *, allow_mask: bool) -> Callable[[], None]:
        """Check ``indices`` (the caller's argument ``name``) and gather every buffer aside; the
        returned function installs them. Like ``DynamicLayer``, a layer holding no token is left
        alone, but the indices are still checked."""
        cc = self.codec_cache
        if not cc.offset:
            batch_index(name, indices, None if cc.keys is None else cc.keys.batch, allow_mask=allow_mask)
            return _nothing
        return self._then_refresh(cc.plan_reorder(indices, name=name, allow_mask=allow_mask))

    # Offloading would move views of the memoized reconstruction, not the archive: unsupported.
    def offload(self) -> None:
        """No-op: codec layers are never offloaded."""

    def prefetch(self) -> None:
        """No-op: codec layers are never offloaded."""

    # ------------------------------------------------------------------ bytes
    def storage_bytes(self) -> CodecStorage:
        """Measured bytes of this layer (keys + values): see :class:`flashcodec.CodecStorage`."""
        return self.codec_cache.storage_bytes()
