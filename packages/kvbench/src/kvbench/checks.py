"""Shape checks of kvbench's inputs that several modules share: a compare result document and
plain values. Each raises :class:`kvbench.errors.CompareError` (a ``KVSpecError`` and a
``ValueError``) naming what was given, what is wrong and what is expected, before anything is
printed, drawn or written."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import CompareError

__all__ = ["check_count", "check_result", "check_rows", "check_token_lists"]


def check_count(name: str, value: object, *, low: int = 0) -> int:
    """``value`` when it is an integer (not a bool) >= ``low``; CompareError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise CompareError(f"{name} must be an integer >= {low}; got {value!r}")
    return int(value)


def check_rows(rows: object, where: str) -> list[dict[str, Any]]:
    """A run's rows: a non-empty list of dicts, each with a ``name``."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or not rows:
        raise CompareError(f"{where} must be a non-empty list of result rows; got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or not isinstance(row.get("name"), str):
            raise CompareError(f"{where}[{i}] must be a result row (a dict with a 'name'); got {row!r:.80}")
    return list(rows)  # type: ignore[arg-type]


def check_result(result: object, where: str = "result") -> dict[str, Any]:
    """A compare document as :func:`kvbench.results.build_result` writes it: a dict whose ``runs``
    is a non-empty list of ``{"name": str, "rows": [...]}``; CompareError naming the first problem."""
    if not isinstance(result, Mapping):
        raise CompareError(f"{where} must be a compare document (a dict); got {type(result).__name__}")
    runs = result.get("runs")
    if isinstance(runs, (str, bytes)) or not isinstance(runs, Sequence) or not runs:
        raise CompareError(f"{where} has no 'runs' list (is it a kvbench compare result?); got {runs!r:.80}")
    for i, run in enumerate(runs):
        if not isinstance(run, Mapping) or not isinstance(run.get("name"), str):
            raise CompareError(f"{where}['runs'][{i}] must be a dict with a 'name'; got {run!r:.80}")
        check_rows(run.get("rows"), f"{where}['runs'][{i}]['rows']")
    return result  # type: ignore[return-value]


def check_token_lists(name: str, value: object, *, length: int | None = None) -> list[list[int]]:
    """A non-empty list of non-empty token-id lists (each of ``length`` tokens when given)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise CompareError(f"{name} must be a non-empty list of token-id lists; got {value!r:.80}")
    out = []
    for i, tokens in enumerate(value):
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not tokens:
            raise CompareError(f"{name}[{i}] must be a non-empty list of token ids; got {tokens!r:.80}")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise CompareError(f"{name}[{i}] must hold token ids (integers >= 0)")
        if length is not None and len(tokens) != length:
            raise CompareError(f"{name}[{i}] has {len(tokens)} tokens; every one must have {length}")
        out.append(list(tokens))
    return out
