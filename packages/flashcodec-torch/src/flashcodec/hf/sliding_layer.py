"""FlashCodecSlidingLayer: a sliding-window attention layer's cache, block-coded and bounded.

transformers' ``DynamicSlidingWindowLayer`` keeps the newest ``sliding_window - 1`` tokens at 16
bits. This layer codes them like a full-attention codec layer and forgets whole archived blocks
once no later query can see them: before a step whose first query sits at position ``p``, every
archived block that ends before ``p - sliding_window + 1`` is dropped. The codec's raw window of
newest tokens is cut to an eighth of the attention window (:func:`window_codec`). It keeps whole
blocks, so up to ``block_size - 1`` tokens older than the window stay (the model's sliding mask,
built from :meth:`FlashCodecSlidingLayer.get_mask_sizes`, hides them), and it can undo a crop as
far as those spare tokens reach without recording anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from kvspec import KVShapeError, KVTrimError

from ..validate import check_int
from .layer import FlashCodecLayer

__all__ = ["FlashCodecSlidingLayer", "window_codec"]

#: a sliding layer's raw (int8 or 16-bit) window is at most this fraction of its attention window
RAW_SHARE = 8


def window_codec(codec: Any, sliding_window: int) -> Any:
    """``codec`` for a layer of window ``sliding_window``: its ``raw_window`` (the newest tokens
    kept out of the blocks) cut to at most ``sliding_window // RAW_SHARE``. A window of 128 would
    otherwise hold half its tokens at 8 bits (the default's 64); windows of 512 and more keep the
    codec as it is."""
    raw = getattr(codec, "raw_window", 0)
    limit = sliding_window // RAW_SHARE
    if not raw or raw <= limit or not dataclasses.is_dataclass(codec):
        return codec
    return dataclasses.replace(codec, raw_window=limit)


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
        n = check_int("tokens_to_remove", tokens_to_remove, error=KVTrimError)
        seen = self.get_seq_length()
        keep = n if n > 0 else max(0, seen + n)
        if keep < seen and self.dropped and keep - self.sliding_window + 1 < self.dropped:
            raise KVTrimError(
                f"crop({tokens_to_remove}): a sliding layer of window {self.sliding_window} forgot its first "
                f"{self.dropped} tokens, and the next query after keeping {keep} would see back to position "
                f"{max(0, keep - self.sliding_window + 1)}; nothing was cropped"
            )
        return super().plan_crop(keep - seen)  # 0 (nothing to remove) changes nothing
