"""What a model attends on for a while: the stored codes, or a decoded (materialized) view.

``attending_on(model, "codes")`` applies :func:`flashcodec.hf.apply_codec_attention` for the
``with`` block and removes it after, whatever happens inside; ``"materialized"`` leaves the model
as it is. Measuring scripts, ``flashcodec compare`` and the demo go through this one context
manager, so every one of them switches attention the same way.

    with attending_on(model, tier.attention) as stats:  # stats: CodecAttentionStats or None
        model.generate(ids, cache=FlashCodecCache.from_config(model.config, codec=tier.codec))
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..tiers import check_attention
from .codec_attention import CodecAttentionStats, apply_codec_attention, remove_codec_attention

__all__ = ["attending_on", "attention_details"]


@contextlib.contextmanager
def attending_on(
    model: torch.nn.Module, attention: str, *, backend: str = "auto", quiet: bool = False
) -> Iterator[CodecAttentionStats | None]:
    """Within the block, ``model`` attends on the codes (``attention="codes"``: yields the
    :class:`CodecAttentionStats` that count its steps) or as it already does
    (``"materialized"``: yields None). ``backend`` goes to :func:`apply_codec_attention`;
    ``quiet`` silences its warnings (a measuring run prints its own progress)."""
    check_attention(attention)
    if attention == "materialized":
        yield None
        return
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        stats = apply_codec_attention(model, backend=backend)
    try:
        yield stats
    finally:
        remove_codec_attention(model)


def attention_details(stats: CodecAttentionStats) -> dict[str, Any]:
    """What a results row records of attention on the codes: steps served each way and fallbacks."""
    return {
        "decode_steps_on_codes": stats.coded,
        "multi_token_steps_chunked": stats.chunked,
        "fallbacks": dict(stats.fallbacks),
    }
