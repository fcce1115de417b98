"""Decode-attention kernels on block-coded rows.

``naive.py``: the pure-torch split-K reference (and the torch backend). ``triton_attention.py``: the
Triton split-K kernel and its log-sum-exp combine. This package imports torch only; triton is
imported when ``flashcodec.kernels.triton_attention`` is, so ``import flashcodec`` works without it.
"""

from .naive import CodedRows, combine_partials, decode_attention_naive, decode_attention_partials

__all__ = ["CodedRows", "combine_partials", "decode_attention_naive", "decode_attention_partials"]
