"""From a memory budget to a tier: ``palu-mlx generate`` / ``server --kv-memory SIZE``.

:func:`plan` takes what a user knows (this much memory for the KV caches of ``users`` sequences of
``context_tokens`` tokens each) and returns the :class:`Plan` with the best-quality tier of
:data:`CANDIDATES` whose caches are predicted to fit.

The prediction is measured on the model itself, not computed from a tier's bits: each candidate's
caches are built for the model and fed random keys and values of the model's head shape and dtype
straight through ``update_and_fetch`` at two lengths (a few hundred tokens), and their ``nbytes``
fitted as ``fixed + per_token * tokens``. What that fit leaves out, it leaves out on purpose:

* the caches' buffers grow in steps of ``step`` tokens (as mlx-lm's ``KVCache``), so the tokens of
  a context are counted rounded up to the next step, as the buffers will hold them;
* sliding-window layers hold at most their window (plus the slack they trim in), however long
  the context;
* layers palu does not replace (a state-space model's state) and everything outside the caches
  (weights, activations, mlx-lm's prompt cache of finished conversations) are not counted;
* a palu tier water-fills its code bits over the channels by their variance, and the widths it
  gives a real model's keys and values can pack into a few more bytes per row than the even
  widths isotropic random data gets, so for palu tiers the prediction can fall a few percent short
  of what a real prefill holds (the rotation tiers' widths are fixed: their bytes do not depend
  on the data).

Measuring is cheap (one layer per kind of cache, no model forward), and only the candidates down
to the first that fits are measured.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from kvspec import KVConfigError
from mlx.utils import tree_flatten

from .builder import KVCacheBuilder, model_kv_dims
from .config import KVCacheConfig
from .tiers import TIERS

__all__ = [
    "CANDIDATES",
    "DEFAULT_CONTEXT_TOKENS",
    "Footprint",
    "Plan",
    "default_context",
    "measure",
    "parse_size",
    "plan",
]

#: the tiers a memory plan chooses from, best quality first: ordered by KL divergence from the
#: uncompressed cache on SmolLM2-135M at 2,048 tokens (benchmarks/results/palu_frontier.json where
#: it measures a tier, else palu_real_model.json): the registry's tiers that need no file, but
#: palu-2bit-scaled (palu-2bit-scaled+rel holds its bytes at a lower KL) and reference-default
#: (no bit budget to plan with). palu-1.75bit-compact has no KL of its own there (only its
#: sensitivity-profile twin does), so it stays last, as the smallest.
CANDIDATES: tuple[str, ...] = (
    "rotation-4bit",
    "rotation-3.5bit",
    "rotation-3bit",
    "palu-2.25bit-scaled+rel",
    "palu-2bit-scaled+rel",
    "palu-1.75bit-compact",
)

#: the context a plan is made for when the model does not say how long its positions go
DEFAULT_CONTEXT_TOKENS = 4096

#: tokens of the shorter of the two synthetic sequences each layer kind is measured at (the longer
#: is twice as long); long enough that every tier has fitted its projections and filled its exact
#: sink and recent tokens, so the growth between the two is per-token bytes alone
_PROBE_TOKENS = 256

#: bytes per element of the uncompressed cache a plan compares with (mlx-lm's 16-bit KVCache)
_UNCOMPRESSED_BYTES = 2

_MIB = 1024**2


# --------------------------------------------------------------------------- sizes
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes of a size such as ``512M``, ``2G``, ``1.5GiB``, ``300MB`` or ``1048576``.

    K, M, G and T are powers of 1024, with or without a trailing ``B`` / ``iB``, as
    ``--prompt-cache-dir-bytes`` reads them. Raises ``KVConfigError`` for anything else, and for
    sizes below one byte (zero, negative).
    """
    match = _SIZE.match(text) if isinstance(text, str) else None
    if match is None:
        if isinstance(text, str) and text.strip().startswith("-"):
            raise KVConfigError(f"{text!r} is negative; a memory size must be positive (e.g. 512M, 2G)")
        raise KVConfigError(
            f"{text!r} is not a size; give a positive number of bytes, optionally with K, M, G or T "
            "(powers of 1024; e.g. 512M, 2G, 1.5GiB)"
        )
    n = math.floor(float(match.group(1)) * 1024 ** " KMGT".index((match.group(2) or " ").upper()))
    if n < 1:
        raise KVConfigError(f"{text!r} is zero bytes; a memory size must be positive (e.g. 512M, 2G)")
    return n


def _mib(n: float) -> str:
    return f"{n / _MIB:.1f} MiB"


def default_context(model: nn.Module) -> int:
    """The context a plan is for when none is given: the model's ``max_position_embeddings`` where
    its args have one, else :data:`DEFAULT_CONTEXT_TOKENS`."""
    n = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        return n
    return DEFAULT_CONTEXT_TOKENS


# --------------------------------------------------------------------------- measuring
@dataclass(frozen=True)
class _Kind:
    """One kind of layer cache of a tier on a model and what it was measured to hold."""

    layers: int  # how many of the model's layers have this kind
    fixed: float  # bytes held whatever the tokens (fitted projections, exact sink / recent tokens)
    per_token: float  # bytes per token of buffer capacity
    step: int  # buffers grow by this many tokens at a time
    bound: int | None  # most tokens the layer holds (a sliding window and its slack); None: all
    elements: int  # key and value elements per token (for the uncompressed comparison)

    def nbytes(self, tokens: int) -> float:
        held = tokens if self.bound is None else min(tokens, self.bound)
        capacity = -(-held // self.step) * self.step
        return self.fixed + self.per_token * capacity


@dataclass(frozen=True)
class Footprint:
    """What one sequence's caches of a tier hold on a model, measured (:func:`measure`)."""

    kinds: tuple[_Kind, ...]

    def nbytes(self, tokens: int) -> int:
        """Predicted bytes of one sequence's caches at ``tokens`` tokens."""
        return math.ceil(sum(k.layers * k.nbytes(tokens) for k in self.kinds))

    def uncompressed_nbytes(self, tokens: int) -> int:
        """Bytes a 16-bit uncompressed cache of the same layers holds at ``tokens`` tokens."""
        return sum(
            k.layers
            * k.elements
            * _UNCOMPRESSED_BYTES
            * (tokens if k.bound is None else min(tokens, k.bound))
            for k in self.kinds
        )

    def most_tokens(self, budget: float) -> int:
        """The most tokens whose predicted bytes are at most ``budget`` (0 when not even one fits)."""
        if self.nbytes(1) > budget:
            return 0
        lo, hi = 1, 2
        while self.nbytes(hi) <= budget:
            if all(k.bound is not None for k in self.kinds) and hi > max(k.bound for k in self.kinds):
                return hi  # every layer is windowed: any length fits
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.nbytes(mid) <= budget else (lo, mid)
        return lo


def _compute_dtype(model: nn.Module) -> mx.Dtype:
    # the keys and values a layer sees are in the dtype of the model's floating weights (a
    # quantized model's scales); the exact tokens a tier keeps are stored in it
    for _, p in tree_flatten(model.parameters()):
        if isinstance(p, mx.array) and mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float16


def _kind_key(cache: Any) -> tuple[str, int | None]:
    return type(cache).__name__, getattr(cache, "max_size", None)


def _held(cache: Any, n_kv: int, head_dim: int, tokens: int, dtype: mx.Dtype, seed: int) -> int:
    k1, k2 = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, n_kv, tokens, head_dim), key=k1).astype(dtype)
    values = mx.random.normal((1, n_kv, tokens, head_dim), key=k2).astype(dtype)
    mx.eval(cache.update_and_fetch(keys, values))
    return int(cache.nbytes)


def measure(model: nn.Module, config: KVCacheConfig) -> Footprint:
    """What one sequence's caches of ``config`` hold on ``model``, measured.

    The caches are built as palu builds them for the model; one layer of each kind (class and
    window: the layers of one kind are built from one config, so they hold the same bytes) is fed
    random keys and values of the model's KV heads, head dim and dtype, fresh at two lengths, and
    its ``nbytes`` fitted to ``fixed + per_token * capacity``. Raises ``KVConfigError`` when the
    model's head dim or KV head count is unknown or no layer gets a palu cache.
    """
    head_dim, n_kv = model_kv_dims(model)
    if head_dim is None or n_kv is None:
        raise KVConfigError(
            "a memory plan needs the model's head dim and KV head count, which its args do not give"
        )
    dtype = _compute_dtype(model)
    layers = KVCacheBuilder.for_model(model, config)
    counts: dict[tuple[str, int | None], int] = {}
    first: dict[tuple[str, int | None], int] = {}
    for i, cache in enumerate(layers):
        if not hasattr(cache, "raw_nbytes"):
            continue  # not a palu cache (a state-space layer's state): not counted
        key = _kind_key(cache)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        raise KVConfigError("the model has no layer a palu cache replaces; there is nothing to plan")
    kinds = []
    for key, i in first.items():
        step = getattr(layers[i], "step", 1)
        step = step if isinstance(step, int) and step > 0 else 1
        short = -(-_PROBE_TOKENS // step) * step
        long_ = 2 * short
        # fresh caches for each length: the projections are fitted at the first update
        at_short = _held(KVCacheBuilder.for_model(model, config)[i], n_kv, head_dim, short, dtype, 0)
        at_long = _held(KVCacheBuilder.for_model(model, config)[i], n_kv, head_dim, long_, dtype, 1)
        window = key[1]
        bound = None
        if window is not None:
            bound = window + int(getattr(layers[i], "slack", 0) or 0)
        if bound is not None and bound <= long_:
            # the window was full at the longer length: what it held there is what it holds
            per_token, fixed = 0.0, float(at_long)
        else:
            per_token = (at_long - at_short) / (long_ - short)
            fixed = at_short - per_token * short
        kinds.append(_Kind(counts[key], fixed, per_token, step, bound, 2 * n_kv * head_dim))
    return Footprint(tuple(kinds))


# --------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class Plan:
    """The tier a memory budget buys (:func:`plan`).

    Attributes:
        tier: the chosen tier's name (:data:`~palu_mlx.tiers.TIERS`).
        description: the tier's one-line description.
        config: the tier's config sized for the model (:meth:`~palu_mlx.tiers.Tier.for_head_dim`).
        memory_bytes, context_tokens, users: what was asked for.
        predicted_bytes: the KV caches' bytes for ``users`` sequences of ``context_tokens``,
            extrapolated from the tier's measured :class:`Footprint` on the model.
        uncompressed_bytes: what 16-bit uncompressed caches of the same tokens hold.
    """

    tier: str
    description: str
    config: KVCacheConfig
    memory_bytes: int
    context_tokens: int
    users: int
    predicted_bytes: int
    uncompressed_bytes: int

    def summary(self) -> str:
        """The one line ``palu-mlx generate`` / ``server`` report at startup."""
        return (
            f"KV memory plan: {self.tier} for {self.users} x {self.context_tokens} tokens: "
            f"{_mib(self.predicted_bytes)} of {_mib(self.memory_bytes)} "
            f"(uncompressed: {_mib(self.uncompressed_bytes)})"
        )


def _positive_int(value: Any, name: str, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KVConfigError(f"{name}={value!r} must be an integer >= 1 ({meaning})")
    return value


def plan(
    model: nn.Module,
    memory_bytes: int,
    context_tokens: int,
    users: int = 1,
    candidates: Sequence[str] = CANDIDATES,
) -> Plan:
    """The best-quality tier of ``candidates`` (best first) whose caches for ``users`` sequences of
    ``context_tokens`` tokens are predicted to fit in ``memory_bytes`` on ``model``.

    Candidates are measured (:func:`measure`) best first until one fits. Raises ``KVConfigError``
    for arguments that are not positive integers, a candidate that is not a tier of
    :data:`~palu_mlx.tiers.TIERS`, and when even the last candidate does not fit: the message
    says what it needs and the longest context that fits for that many users.
    """
    _positive_int(memory_bytes, "memory_bytes", "bytes for the KV caches")
    _positive_int(context_tokens, "context_tokens", "tokens per sequence")
    _positive_int(users, "users", "sequences held at once")
    if not candidates:
        raise KVConfigError("candidates must name at least one tier")
    unknown = [name for name in candidates if name not in TIERS]
    if unknown:
        raise KVConfigError(f"candidates {unknown!r} are not palu tiers; allowed: {', '.join(TIERS)}")
    head_dim, _ = model_kv_dims(model)
    if head_dim is None:
        raise KVConfigError("a memory plan needs the model's head dim, which its args do not give")
    smallest: tuple[int, str, Footprint] | None = None
    for name in candidates:
        tier = TIERS[name]
        config = tier.for_head_dim(head_dim)
        footprint = measure(model, config)
        need = users * footprint.nbytes(context_tokens)
        if smallest is None or need < smallest[0]:
            smallest = (need, name, footprint)
        if need <= memory_bytes:
            return Plan(
                tier=name,
                description=tier.description,
                config=config,
                memory_bytes=memory_bytes,
                context_tokens=context_tokens,
                users=users,
                predicted_bytes=need,
                uncompressed_bytes=users * footprint.uncompressed_nbytes(context_tokens),
            )
    # the candidate needing least at this context, by measurement (the list is ordered by quality)
    need, name, footprint = smallest
    most = footprint.most_tokens(memory_bytes / users)
    fits = (
        f"at {_mib(memory_bytes)} it fits at most {most} tokens per sequence for {users} "
        f"sequence{'s' if users > 1 else ''}"
        if most
        else f"at {_mib(memory_bytes)} not even one token per sequence fits for {users} "
        f"sequence{'s' if users > 1 else ''} (it needs {_mib(users * footprint.nbytes(1))})"
    )
    raise KVConfigError(
        f"{_mib(memory_bytes)} is too little KV memory for {users} x {context_tokens} tokens: the "
        f"smallest tier, {name}, needs {_mib(need)}; {fits}. Give more memory, a shorter context "
        "or fewer users"
    )
