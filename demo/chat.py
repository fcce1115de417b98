"""One side of a chat turn: a fresh cache, the conversation prefilled, greedy tokens one call each.

The calls are the kvbench runner's (``prefill``, ``step``, ``kv_bytes``, ``reset_peak``,
``peak_bytes``), the same that ``flashcodec compare`` / ``palu-mlx compare`` time and meter, and
the cache comes from the same :class:`kvbench.protocol.Candidate` those commands build. A fresh
cache each turn (the side's whole conversation prefilled again) makes every turn's figures cover
the whole conversation the cache would hold, comparable from turn to turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import numpy as np
from kvbench.protocol import Candidate, Runner

from .stats import SideStats

__all__ = ["generate"]


def generate(
    runner: Runner,
    candidate: Candidate,
    context: Sequence[int],
    new_tokens: int,
    stop_tokens: frozenset[int],
    memory_now: Callable[[], int | None],
    on_token: Callable[[list[int]], None],
    label: str | None = None,
) -> tuple[list[int], SideStats]:
    """Greedy reply to ``context`` with ``candidate``'s cache; ``on_token(tokens so far)`` after
    each token. Stops after ``new_tokens`` tokens or at a token of ``stop_tokens`` (kept).

    ``memory_now``: bytes in use now by the framework (the steady figure is its rise over the
    turn, read while the cache is still alive). Returns the reply's tokens and the turn's stats.
    """
    entered = candidate.context() if candidate.context is not None else nullcontext()
    with entered:
        runner.reset_peak()
        base = memory_now()
        cache = candidate.make_cache()
        started = time.perf_counter()
        logits = runner.prefill(cache, list(context))
        prefill_s = time.perf_counter() - started
        tokens: list[int] = []
        steps: list[float] = []
        while True:
            token = int(np.argmax(logits))
            tokens.append(token)
            on_token(list(tokens))
            if len(tokens) >= new_tokens or token in stop_tokens:
                break
            started = time.perf_counter()
            logits = runner.step(cache, token)
            steps.append(time.perf_counter() - started)
        peak = runner.peak_bytes()
        kv = runner.kv_bytes(cache)
        now = memory_now()
        details = candidate.details() if candidate.details is not None else None
    del cache
    return tokens, SideStats(
        name=label or candidate.name,
        context_tokens=len(context),
        new_tokens=len(tokens),
        kv_held=int(kv.held),
        kv_resident=None if kv.resident is None else int(kv.resident),
        peak_bytes=peak,
        steady_bytes=None if base is None or now is None else max(0, now - base),
        prefill_s=prefill_s,
        step_s=tuple(steps),
        details=details,
    )
