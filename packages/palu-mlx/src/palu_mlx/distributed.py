"""Tensor parallel: one palu codec across the ranks that each hold a share of a model's KV heads.

``mlx_lm.utils.sharded_load`` splits every attention layer's KV heads into ``world`` contiguous
slices: rank ``r`` computes heads ``[r * h, (r + 1) * h)`` of ``world * h``. A palu cache on a
rank then sees only its heads. Whatever a fit decides per head (a head's projection, its
quantizer steps) is the same as in one process; what it decides *across* heads is not: the
water-filling widths (from the head-averaged latent variances), a rank chosen by energy (the
smallest over the groups) and a bit allocation over the groups' singular values. A
:class:`HeadShard` gathers those per-head statistics from every rank (``mx.distributed``'s
``all_gather``, in head order) before the decision, so every rank takes the one a single process
takes and each head gets the bits one process would give it.

The builder makes one when the model's attention computes fewer KV heads than its config names
(:func:`head_shard`); the caches call :meth:`HeadShard.gather` once per layer at the fit, in
layer order on every rank (the forward pass runs in lockstep). A whole-model calibration file
serves a shard too: each rank checks the file's weight fingerprint against the whole model's
(its shard's sums, :meth:`HeadShard.all_sum`-ed) and takes its heads' slices of the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError

__all__ = ["HeadShard", "head_shard", "model_total_kv_heads"]


@dataclass(frozen=True)
class HeadShard:
    """This rank's slice of the KV heads: ``heads`` of ``total`` (rank ``rank`` of ``group``)."""

    group: Any
    heads: int
    total: int

    def __deepcopy__(self, memo: dict) -> HeadShard:
        # the group is the process's link to the other ranks: copies of a cache share it
        return self

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def world(self) -> int:
        return self.group.size()

    @property
    def head_slice(self) -> slice:
        """The model-wide indices of this rank's heads."""
        return slice(self.rank * self.heads, (self.rank + 1) * self.heads)

    def gather(self, stats: np.ndarray) -> np.ndarray:
        """Per-head statistics ``[heads, ...]`` of this rank -> ``[total, ...]`` of every rank, in head
        order, as float64. The values travel as float32: the statistics are float32 computations, so
        the gathered array is bitwise the one a single process holds."""
        local = np.ascontiguousarray(stats, dtype=np.float32)
        if local.shape[0] != self.heads:
            raise KVConfigError(
                f"gather got statistics of {local.shape[0]} heads; this rank holds {self.heads}"
            )
        # on the current stream, the one the model's own all_sums run on (mlx-lm's generation
        # stream): collectives of two streams in flight at once pair up the ranks' messages wrongly
        out = mx.distributed.all_gather(mx.array(local), group=self.group)
        return np.array(out, dtype=np.float64)

    def all_sum(self, values: np.ndarray) -> np.ndarray:
        """``values`` summed over the ranks (float32 on the wire, float64 back), on the current stream."""
        out = mx.distributed.all_sum(mx.array(np.asarray(values, dtype=np.float32)), group=self.group)
        return np.array(out, dtype=np.float64)


def model_total_kv_heads(model: Any) -> int | None:
    """KV heads of the whole model (its config's ``num_key_value_heads``), whatever a shard computes."""
    args = getattr(model, "args", None)
    return getattr(args, "num_key_value_heads", None) or getattr(args, "num_attention_heads", None)


def head_shard(model: Any, local_heads: int | None) -> HeadShard | None:
    """The :class:`HeadShard` of a tensor-parallel shard (None for a whole model).

    A shard is a model whose attention computes ``local_heads`` of its config's KV heads, in a
    process of a distributed group (``mx.distributed.init()``'s), which must hold
    ``total / local_heads`` ranks (as ``sharded_load(..., tensor_group=mx.distributed.init())``
    makes it), else ``KVConfigError``. Without other ranks (a group of one) there is nothing to
    agree with: the model's caches are fitted on the heads it computes.
    """
    total = model_total_kv_heads(model)
    if local_heads is None or total is None or local_heads >= total:
        return None
    group = mx.distributed.init()
    if group.size() == 1:
        return None
    if total % local_heads or group.size() != total // local_heads:
        raise KVConfigError(
            f"the model computes {local_heads} of its {total} KV heads (a tensor-parallel shard), but the "
            f"distributed group has {group.size()} ranks; palu-mlx needs the heads split evenly over "
            "mx.distributed.init()'s group, as sharded_load(path, tensor_group=mx.distributed.init()) does"
        )
    return HeadShard(group, local_heads, total)
