"""Peer caches for ``palu-mlx compare``: name -> :class:`Peer`, one module per kind.

A peer builds one cache per model layer with :meth:`Peer.make`; a peer that cannot run here
(its package is not installed, the model's shape does not suit it) raises
:class:`PeerUnavailable` with the reason, and ``palu-mlx compare`` lists it under ``absent``.

* :mod:`.mlx_lm_quant`: mlx-lm's ``QuantizedKVCache`` (``mlx-lm-q4``, ``mlx-lm-q8``);
* :mod:`.kivi`: KIVI written in plain MLX, holding packed codes and a 16-bit residual window
  (``kivi-k4v4``, ``kivi-k2v2``);
* :mod:`.velox`: VeloxQuant-MLX's caches (optional: ``pip install "palu-mlx[peers]"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

__all__ = [
    "PeerUnavailable",
    "Peer",
    "PeerCaches",
    "PEERS",
    "peer",
    "plain_layers",
    "resident_nbytes",
]


class PeerUnavailable(Exception):
    """A peer cannot run here or refuses the model; ``reason`` is one line for the ``absent`` row."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = " ".join(str(reason).split())


class PeerCaches(list):
    """The per-layer caches of a peer whose ``nbytes`` is not a measurement of what it holds
    (a cache may report a packed-size estimate while keeping 16-bit tensors): the runner then
    counts the bytes of every array the caches keep (:func:`resident_nbytes`)."""

    count_arrays = True


@dataclass(frozen=True)
class Peer:
    """One peer: ``factory(model)`` returns the per-layer caches (raises PeerUnavailable),
    ``record`` goes into the results' config, ``sized(model)`` adds the entries that depend on
    the model, ``accounted(model, caches)`` (after a run) what the peer itself says it spends."""

    name: str
    description: str
    factory: Callable[[Any], list[Any]]
    record: dict[str, Any] = field(default_factory=dict)
    sized: Callable[[Any], dict[str, Any]] | None = None
    accounted: Callable[[Any, list[Any]], dict[str, Any]] | None = None

    def make(self, model: Any) -> list[Any]:
        """A fresh list of per-layer caches for ``model``; PeerUnavailable when it cannot."""
        return self.factory(model)

    def record_for(self, model: Any) -> dict[str, Any]:
        """``record`` plus the entries sized for ``model``."""
        extra = self.sized(model) if self.sized is not None else {}
        return {**self.record, **extra}


def plain_layers(model: Any, make_one: Callable[[], Any]) -> list[Any]:
    """mlx-lm's default caches for ``model`` with every plain ``KVCache`` replaced by
    ``make_one()``: rotating windows and SSM state keep the model's own cache."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    return [make_one() if type(c) is KVCache else c for c in make_prompt_cache(model)]


def resident_nbytes(obj: Any, _seen: set[int] | None = None, _depth: int = 0) -> int:
    """Bytes of every distinct ``mx.array`` reachable from ``obj`` through attributes, lists,
    tuples and dicts (six levels deep): what an object keeps, whatever it reports."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen or _depth > 6:
        return 0
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(resident_nbytes(v, seen, _depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(resident_nbytes(v, seen, _depth + 1) for v in obj)
    if isinstance(obj, (str, bytes, int, float, bool, type)) or obj is None or callable(obj):
        return 0
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return 0
    return sum(resident_nbytes(v, seen, _depth + 1) for v in attrs.values())


def _registry() -> dict[str, Peer]:
    from . import kivi, mlx_lm_quant, velox

    out: dict[str, Peer] = {}
    for module in (mlx_lm_quant, kivi, velox):
        for p in module.PEERS:
            if p.name in out:
                raise RuntimeError(f"peer {p.name!r} is defined twice")
            out[p.name] = p
    return out


#: every peer, in display order
PEERS: dict[str, Peer] = _registry()


def peer(name: str) -> Peer:
    """The peer called ``name``; KeyError naming the known peers when there is none."""
    try:
        return PEERS[name]
    except KeyError:
        raise KeyError(f"unknown peer {name!r}; known: {', '.join(PEERS)}") from None
