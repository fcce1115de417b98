"""Peak bytes of the tensors torch allocates inside a block of code, on any device (CPU included).

``torch.cuda.max_memory_allocated`` has no CPU counterpart and ``tracemalloc`` does not see torch's
allocator, so this counts at the operator level: a ``TorchDispatchMode`` sees every aten op run
inside the ``with`` block; each op output that owns a new storage adds that storage's bytes, views
and in-place results of a storage already counted add a reference, and a weakref finalizer
subtracts the bytes when the last tensor on that storage dies. ``peak`` is the high-water mark of
the live total; tensors that existed before the block (weights, the cache's archive) are not counted.

What it does not see: scratch memory inside one fused kernel (for example SDPA's internal tiles),
and memory allocated outside aten (numpy, Python). Use it for questions like "did this call build
an ``[S, D]`` tensor?"; on CUDA, ``torch.cuda.max_memory_allocated`` is the complete figure.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["PeakMemory"]


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory() as pm: ...`` then ``pm.peak`` (bytes) and ``pm.largest`` (one tensor's bytes).

    Attributes:
        current: bytes of the storages allocated inside the block that are still alive.
        peak: the largest ``current`` seen.
        largest: the largest single storage allocated inside the block.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, live tensors]
        self.current = 0
        self.peak = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, new_storage=not aliases)
        return out

    def _track(self, t: torch.Tensor, *, new_storage: bool) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        entry = self._live.get(key)
        if entry is None:
            if not new_storage:  # a view or in-place result of memory from before the block
                return
            entry = self._live[key] = [nbytes, 0]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            self.largest = max(self.largest, nbytes)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.current -= entry[0]
