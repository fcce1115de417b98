"""What a cache really keeps: the bytes of every tensor reachable from it, each storage once."""

from __future__ import annotations

import torch

__all__ = ["resident_bytes"]


def resident_bytes(root: object) -> int:
    """Bytes of every tensor storage reachable from ``root`` (a cache, a layer, any object)
    through attributes, lists, tuples, sets and dicts, each storage counted once at its full size
    (spare capacity and the base of a sliced view included). Modules and classes are not entered,
    so a model a cache refers to is not counted."""
    seen_objects: set[int] = set()
    seen_storages: set[tuple[int, int]] = set()
    total, stack = 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
            stack.extend(vars(obj).values())
    return total
