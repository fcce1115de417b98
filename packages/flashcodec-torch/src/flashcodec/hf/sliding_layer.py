"""FlashCodecSlidingLayer: a sliding-window attention layer's cache, block-coded and bounded.

transformers' ``DynamicSlidingWindowLayer`` keeps the newest ``sliding_window - 1`` tokens at 16
bits. This layer codes them like a full-attention codec layer and forgets whole archived blocks
once no later query can see them: before a step whose first query sits at position ``p``, every
archived block that ends before ``p - sliding_window + 1`` is dropped. The codec's tail (raw window
and the block being filled) is cut to an eighth of the attention window (:func:`window_codec`). It
keeps whole blocks, so up to ``block_size - 1`` tokens older than the window stay (the model's sliding mask,
built from :meth:`FlashCodecSlidingLayer.get_mask_sizes`, hides them), and it can undo a crop as
far as those spare tokens reach without recording anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from kvspec import KVConfigError, KVShapeError, KVTrimError

from ..validate import check_int
from .layer import FlashCodecLayer

__all__ = ["FlashCodecSlidingLayer", "window_codec"]

#: a sliding layer's tail (the raw window plus the block being filled, int8 or 16-bit) holds at
#: most this fraction of its attention window
TAIL_SHARE = 8
#: the smallest block a sliding layer's codec is cut to (side information per block grows past it)
MIN_BLOCK = 8


def window_codec(codec: Any, sliding_window: int) -> Any:
    """``codec`` for a layer of window ``sliding_window``, its tail (``raw_window`` plus up to
    ``block_size - 1`` tokens not yet archived) at most ``sliding_window // TAIL_SHARE`` tokens:
    ``block_size`` cut to the largest power of two within that share (at least ``MIN_BLOCK``),
    ``raw_window`` to what is left of it. A window of 128 keeps 16-token blocks and no raw window
    (64-token blocks would hold up to 79 of its 128 tokens at 8 bits, and up to 63 behind it);
    windows of 1,024 and more keep the default codec as it is."""
    if not dataclasses.is_dataclass(codec) or not hasattr(codec, "block_size"):
        return codec
    share = sliding_window // TAIL_SHARE
    block = codec.block_size
    if block > share:
        block = max(MIN_BLOCK, 1 << max(0, share.bit_length() - 1))
    raw = getattr(codec, "raw_window", 0)
    changes = {}
    if block < codec.block_size:
        changes["block_size"] = block
    if raw > max(0, share - block):
        changes["raw_window"] = max(0, share - block)
    if not changes:
        return codec
    try:
        return dataclasses.replace(codec, **changes)
    except KVConfigError:  # a field tied to the block size (a sink longer than the cut block, ...)
        return codec


class FlashCodecSlidingLayer(FlashCodecLayer):
    """A :class:`FlashCodecLayer` for a ``sliding_attention`` layer of window ``sliding_window``.

    Args:
        sliding_window: the model's window (an integer >= 1): a query at position ``p`` sees the
            keys at positions ``p - sliding_window + 1 .. p``.
        options: as :class:`FlashCodecLayer`.

    ``get_seq_length()`` counts every token seen (as ``DynamicSlidingWindowLayer`` does);
    ``dropped`` are the tokens forgotten at the front, ``codec_cache.offset`` the tokens held.
    ``update`` returns the held tokens and the step's (shapes ``[B, H, held + s, D]``).
    """

    is_sliding = True

    def __init__(self, sliding_window: int, **options: Any):
        super().__init__(**options)
        self.sliding_window = check_int("sliding_window", sliding_window, low=1)
        #: tokens forgotten at the front (whole blocks behind the window)
        self.dropped = 0

    def __repr__(self) -> str:
        return (
            f"FlashCodecSlidingLayer({self.codec_cache.codec!r}, window={self.sliding_window}, "
            f"seq_len={self.get_seq_length()}, held={self.codec_cache.offset})"
        )

    def _blocks_behind(self) -> int:
        """Archived blocks that no query from the next position on can see."""
        cc = self.codec_cache
        first_visible = cc.offset - self.sliding_window + 1  # relative to the first held token
        return min(max(0, first_visible) // cc.codec.block_size, cc.archived_blocks())

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step, forget the blocks behind the window, return the held tokens and the
        step's (or, attending on the codes, the step's tagged tensors)."""
        drop = self._blocks_behind()
        keys, values = super().update(key_states, value_states, *args, **kwargs)  # validates first
        if drop:
            self.codec_cache.drop_front(drop)
            self.dropped += drop * self.codec_cache.codec.block_size
            if keys.shape[-2] > self.codec_cache.offset:  # a view that still starts at the dropped blocks
                cut = drop * self.codec_cache.codec.block_size
                keys, values = keys[:, :, cut:], values[:, :, cut:]
                if self.keys is not None and self.keys.shape[-2] > self.codec_cache.offset:
                    self.keys, self.values = self.keys[:, :, cut:], self.values[:, :, cut:]
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens seen: those dropped and those held."""
        return self.dropped + self.codec_cache.offset

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the next update: the held tokens left after its drop plus
        the ``query_length`` new ones, starting at absolute position ``kv_offset``."""
        query_length = check_int("query_length", query_length, low=0, error=KVShapeError)
        drop = self._blocks_behind() * self.codec_cache.codec.block_size
        return self.codec_cache.offset - drop + query_length, self.dropped + drop

    def get_max_length(self) -> int:
        """The window, as ``DynamicSlidingWindowLayer`` reports it."""
        return self.sliding_window

    def reset(self) -> None:
        super().reset()
        self.dropped = 0

    def plan_crop(self, tokens_to_remove: int) -> Callable[[], None]:
        """As :meth:`FlashCodecLayer.plan_crop` (a positive value keeps the first ``n`` tokens
        seen); ``KVTrimError`` when the next query's window would reach tokens already dropped."""
        n = check_int("max_length", tokens_to_remove, error=KVTrimError)
        seen = self.get_seq_length()
        keep = n if n > 0 else max(0, seen + n)
        if keep < seen and self.dropped and keep - self.sliding_window + 1 < self.dropped:
            raise KVTrimError(
                f"crop({tokens_to_remove}): a sliding layer of window {self.sliding_window} forgot its first "
                f"{self.dropped} tokens, and the next query after keeping {keep} would see back to position "
                f"{max(0, keep - self.sliding_window + 1)}; nothing was cropped"
            )
        return super().plan_crop(keep - seen)  # 0 (nothing to remove) changes nothing
