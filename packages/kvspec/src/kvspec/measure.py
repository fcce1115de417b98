"""The side-by-side measuring protocol, shared by ``palu-mlx compare`` and ``flashcodec compare``.

The two commands differ only in how they load a model and build caches; the protocol is decided
here, once, so their results are comparable:

* :func:`measure` runs the same protocol for every candidate cache (the uncompressed baseline,
  each tier of a package, each peer cache of its stack) through a :class:`Runner` the framework
  provides, and returns one row per candidate with every figure measured in that run;
* :func:`build_result` stamps the rows with the machine, the package versions and the date
  (:func:`kvspec.results.environment_stamp`) into the JSON layout ``kvspec.compare/1``.

The protocol, per candidate (``windows`` are token windows of held-out text):

1. for each window: a fresh cache, one prefill call on its first ``context_tokens`` tokens
   then the rest fed one token per call, scoring the negative
   log-likelihood of every fed token from the logits before it. This is teacher-forced decoding:
   every scored prediction reads the compressed history exactly as generation would. The cache's
   bytes are measured after the first window (all candidates then hold the same tokens);
2. for each prompt: a fresh cache, prefill, then ``new_tokens`` greedy tokens;
3. peak memory over 1 and 2, as the runner measures it (its label goes into the JSON);
4. after every candidate went through 1-3: ``speed_rounds`` rounds, each visiting every
   candidate in turn: a fresh cache, one timed prefill of a window's context, ``speed_steps``
   timed one-token calls. The best round counts (machine load only ever adds time).

Only numpy and the standard library are imported; tqdm is imported when used.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .results import CompareError, environment_stamp

__all__ = [
    "SCHEMA",
    "MEASURES",
    "KVBytes",
    "Runner",
    "Candidate",
    "Settings",
    "text_windows",
    "token_nll",
    "measure",
    "build_result",
]

#: the JSON layout written by :func:`build_result`
SCHEMA = "kvspec.compare/1"

#: what each measured column means (copied into every result, so a JSON file explains itself)
MEASURES: dict[str, str] = {
    "kv_bytes": "bytes of every array the cache held after the first window (context + scored tokens), "
    "summed from the arrays' .nbytes as the cache reports them",
    "kv_raw_bytes": "bytes the uncompressed baseline cache held for exactly the same tokens "
    "(its K/V arrays cut to the tokens held, no spare capacity)",
    "kv_ratio": "kv_bytes / kv_raw_bytes (below 1: fewer bytes than the uncompressed cache needs)",
    "nll": "mean negative log-likelihood (nats/token) of the scored tokens of every window, "
    "teacher-forced: prefill the context, then feed one true token per call",
    "perplexity": "exp(nll)",
    "ppl_delta": "perplexity - baseline perplexity, same tokens, same run",
    "token_match": "share of greedy tokens equal to the baseline's at the same position (all prompts)",
    "first_divergence": "mean index of the first greedy token that differs from the baseline "
    "(new_tokens when none differs)",
    "decode_tokens_per_s": "1 / median seconds of a one-token call, over speed_steps calls after prefilling "
    "a window's context; best of speed_rounds rounds that visit every cache in turn",
    "decode_speed_ratio": "decode_tokens_per_s / baseline decode_tokens_per_s (above 1: faster)",
    "prefill_seconds": "seconds of the prefill call on a window's context, best of the same rounds",
    "prefill_time_ratio": "prefill_seconds / baseline prefill_seconds (above 1: slower)",
}

_KINDS = ("baseline", "tier", "peer")


@dataclass(frozen=True)
class KVBytes:
    """Bytes a cache held: ``held`` (what :data:`MEASURES` calls kv_bytes) and, where the cache
    reports it, ``resident`` (held plus spare capacity and decoded views)."""

    held: int
    resident: int | None = None


class Runner(Protocol):
    """What a framework provides to :func:`measure` (one model, one tokenizer).

    ``prefill`` and ``step`` must finish their computation before returning (they return numpy
    logits, which forces it), so the wall time around them is the compute time.
    """

    #: what ``peak_bytes`` measures, in words (goes into the JSON and the table footer)
    peak_label: str

    def prefill(self, cache: Any, tokens: Sequence[int]) -> np.ndarray:
        """Feed ``tokens`` (one call); return the last position's logits, float ``[V]``."""
        ...

    def step(self, cache: Any, token: int) -> np.ndarray:
        """Feed one token; return its logits, float ``[V]``."""
        ...

    def kv_bytes(self, cache: Any) -> KVBytes:
        """Bytes the cache holds now."""
        ...

    def raw_bytes(self, cache: Any) -> int:
        """For a baseline cache: bytes of its K/V arrays cut to the tokens held."""
        ...

    def reset_peak(self) -> None:
        """Start a peak-memory window."""
        ...

    def peak_bytes(self) -> int | None:
        """Peak bytes since :meth:`reset_peak` (None when it cannot be measured here)."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``."""
        ...


@dataclass(frozen=True)
class Candidate:
    """One cache to compare: ``make_cache()`` returns a fresh cache for the runner.

    ``context``: an optional context-manager factory entered around this candidate's whole run
    (e.g. a patch of the model that must not touch the other candidates). ``details``: an
    optional function called after the run whose dict goes into the row (e.g. counters proving a
    code path was taken).
    """

    name: str
    kind: str
    description: str
    make_cache: Callable[[], Any]
    config: dict[str, Any] = field(default_factory=dict)
    context: Callable[[], AbstractContextManager[Any]] | None = None
    details: Callable[[], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind={self.kind!r}; allowed: {', '.join(_KINDS)}")


@dataclass(frozen=True)
class Settings:
    """How much text each candidate sees (see the module docstring for the protocol)."""

    windows: int = 4
    context_tokens: int = 192
    scored_tokens: int = 64
    new_tokens: int = 32
    speed_rounds: int = 3
    speed_steps: int = 16
    prompt_count: int = 2

    def __post_init__(self) -> None:
        for name in (
            "windows",
            "context_tokens",
            "scored_tokens",
            "new_tokens",
            "speed_rounds",
            "speed_steps",
            "prompt_count",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CompareError(f"--{name.replace('_', '-')}={value!r} must be a positive integer")
        if self.prompt_count > self.windows:
            raise CompareError(
                f"--prompt-count={self.prompt_count} must not exceed --windows={self.windows} "
                "(default prompts are the windows' contexts)"
            )

    @property
    def window_tokens(self) -> int:
        return self.context_tokens + self.scored_tokens


def text_windows(tokens: Sequence[int], settings: Settings) -> list[list[int]]:
    """``settings.windows`` non-overlapping windows of ``window_tokens`` tokens, spread evenly
    over ``tokens`` (first window at the start). Raises CompareError when the text is too short."""
    n, length = settings.windows, settings.window_tokens
    if len(tokens) < n * length:
        raise CompareError(
            f"--text has {len(tokens)} tokens; {n} windows of {length} tokens "
            f"(--context-tokens + --scored-tokens) need {n * length}: pass a longer text or fewer/shorter windows"
        )
    stride = (len(tokens) - length) // (n - 1) if n > 1 else 0
    return [list(tokens[i * stride : i * stride + length]) for i in range(n)]


def token_nll(logits: np.ndarray, token: int) -> float:
    """Negative log-likelihood (nats) of ``token`` under ``logits [V]`` (computed in float64)."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    top = z.max()
    return float(top + np.log(np.exp(z - top).sum()) - z[token])


class _Progress:
    """tqdm on stderr when installed and wanted; otherwise one line per candidate (or nothing)."""

    def __init__(self, total: int, enabled: bool):
        self._bar = None
        self._enabled = enabled
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, unit="tok", file=sys.stderr, dynamic_ncols=True, leave=False)

    def start(self, name: str) -> None:
        if self._bar is not None:
            self._bar.set_description(name)
        elif self._enabled:
            print(f"  measuring {name} ...", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def measure(
    runner: Runner,
    candidates: Sequence[Candidate],
    windows: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]],
    settings: Settings,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run the protocol for every candidate; the first must be the baseline.

    ``windows``: token windows of ``settings.window_tokens`` each (:func:`text_windows`);
    ``prompts``: token lists for greedy generation. Returns one row (a dict of the
    :data:`MEASURES` fields plus name, kind, description, config and a text sample) per candidate,
    with ratios taken against the baseline row of this same run.

    Quality, bytes and peak memory are measured one candidate after the other; speed afterwards,
    in ``settings.speed_rounds`` rounds that visit every candidate in turn, so a change of machine
    load during the run slows every candidate alike instead of whichever ran at the time.
    """
    if not candidates or candidates[0].kind != "baseline":
        raise ValueError("the first candidate must be the baseline")
    if not windows or not prompts:
        raise ValueError("measure needs at least one window and one prompt")
    ctx = settings.context_tokens
    quality_steps = sum(len(w) - ctx for w in windows) + len(prompts) * settings.new_tokens
    speed_steps = settings.speed_rounds * settings.speed_steps
    bar = _Progress(total=(quality_steps + speed_steps) * len(candidates), enabled=progress)
    rows: list[dict[str, Any]] = []
    _warm_up(runner, candidates[0], windows[0][:ctx])
    try:
        raw_bytes = None
        base_tokens: list[list[int]] | None = None
        for cand in candidates:
            bar.start(cand.name)
            with _entered(cand):
                row, generations, raw = _measure_quality(runner, cand, windows, prompts, settings, bar)
            if cand.kind == "baseline":
                raw_bytes, base_tokens = raw, generations
            row["kv_raw_bytes"] = raw_bytes
            row["kv_ratio"] = row["kv_bytes"] / raw_bytes if raw_bytes else None
            row.update(_greedy_agreement(generations, base_tokens, settings.new_tokens))
            rows.append(row)
        prefill: list[list[float]] = [[] for _ in candidates]
        decode: list[list[float]] = [[] for _ in candidates]
        for round_index in range(settings.speed_rounds):
            window = windows[round_index % len(windows)]
            for i, cand in enumerate(candidates):
                bar.start(f"speed {round_index + 1}/{settings.speed_rounds}: {cand.name}")
                with _entered(cand):
                    p, d = _time_once(runner, cand, window, settings, bar)
                prefill[i].append(p)
                decode[i].append(d)
        for i, (cand, row) in enumerate(zip(candidates, rows, strict=True)):
            # best round: contention only ever adds time, so the fastest round is the cleanest
            row["decode_tokens_per_s"] = 1.0 / min(decode[i])
            row["prefill_seconds"] = min(prefill[i])
            row["decode_steps_timed"] = speed_steps
            if cand.details is not None:
                row["details"] = cand.details()
    finally:
        bar.close()
    _add_ratios(rows)
    return rows


def _entered(cand: Candidate) -> AbstractContextManager[Any]:
    return cand.context() if cand.context is not None else nullcontext()


def _warm_up(runner: Runner, baseline: Candidate, tokens: Sequence[int], steps: int = 8) -> None:
    # First calls pay one-time costs (kernel selection, allocator growth, lazy imports) that
    # would otherwise be charged to the baseline, which runs first.
    cache = baseline.make_cache()
    logits = runner.prefill(cache, tokens)
    for _ in range(steps):
        logits = runner.step(cache, int(np.argmax(logits)))


def _time_once(runner: Runner, cand: Candidate, window: Sequence[int], settings: Settings, bar: _Progress):
    """``(prefill seconds, median seconds of one decode step)`` on a fresh cache for ``window``."""
    ctx = settings.context_tokens
    cache = cand.make_cache()
    t = time.perf_counter()
    logits = runner.prefill(cache, window[:ctx])
    prefill = time.perf_counter() - t
    feed = list(window[ctx:]) or [int(np.argmax(logits))]
    steps = []
    for k in range(settings.speed_steps):
        token = int(feed[k % len(feed)])
        t = time.perf_counter()
        runner.step(cache, token)
        steps.append(time.perf_counter() - t)
        bar.update()
    return prefill, statistics.median(steps)


def _measure_quality(runner, cand, windows, prompts, settings, bar):
    ctx = settings.context_tokens
    started = time.perf_counter()
    runner.reset_peak()
    nll_total, scored = 0.0, 0
    kv = None
    raw = None
    for index, window in enumerate(windows):
        cache = cand.make_cache()
        logits = runner.prefill(cache, window[:ctx])
        for token in window[ctx:]:
            nll_total += token_nll(logits, token)
            scored += 1
            logits = runner.step(cache, int(token))
            bar.update()
        if index == 0:
            kv = runner.kv_bytes(cache)
            if cand.kind == "baseline":
                raw = runner.raw_bytes(cache)
        del cache
    generations: list[list[int]] = []
    for prompt in prompts:
        cache = cand.make_cache()
        logits = runner.prefill(cache, prompt)
        out: list[int] = []
        for k in range(settings.new_tokens):
            token = int(np.argmax(logits))
            out.append(token)
            bar.update()
            if k + 1 < settings.new_tokens:
                logits = runner.step(cache, token)
        generations.append(out)
        del cache
    peak = runner.peak_bytes()
    nll = nll_total / scored
    row = {
        "name": cand.name,
        "kind": cand.kind,
        "description": cand.description,
        "config": cand.config,
        "kv_tokens": len(windows[0]),
        "kv_bytes": int(kv.held),
        "kv_resident_bytes": None if kv.resident is None else int(kv.resident),
        "peak_memory_bytes": None if peak is None else int(peak),
        "nll": nll,
        "perplexity": math.exp(nll),
        "sample": runner.detokenize(generations[0]),
        "elapsed_seconds": time.perf_counter() - started,
    }
    return row, generations, raw


def _greedy_agreement(tokens: list[list[int]], base: list[list[int]], new_tokens: int) -> dict[str, float]:
    same = sum(
        a == b for ours, theirs in zip(tokens, base, strict=True) for a, b in zip(ours, theirs, strict=True)
    )
    firsts = []
    for ours, theirs in zip(tokens, base, strict=True):
        diverged = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
        firsts.append(diverged[0] if diverged else new_tokens)
    return {"token_match": same / (len(base) * new_tokens), "first_divergence": sum(firsts) / len(firsts)}


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    for row in rows:
        row["ppl_delta"] = row["perplexity"] - base["perplexity"]
        row["decode_speed_ratio"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        row["prefill_time_ratio"] = row["prefill_seconds"] / base["prefill_seconds"]


def build_result(
    *,
    tool: str,
    packages: Iterable[str],
    model: dict[str, Any],
    settings: Settings,
    inputs: dict[str, Any],
    peak_label: str,
    rows: list[dict[str, Any]],
    absent: Sequence[dict[str, str]] = (),
) -> dict[str, Any]:
    """The ``kvspec.compare/1`` document: stamp, model, settings, what each column measures, rows.

    ``absent``: ``{"name", "kind", "reason"}`` for every candidate that could not run here.
    """
    measures = dict(MEASURES)
    measures["peak_memory_bytes"] = peak_label
    return {
        "schema": SCHEMA,
        "tool": tool,
        "stamp": environment_stamp(packages),
        "model": model,
        "settings": {
            "windows": settings.windows,
            "context_tokens": settings.context_tokens,
            "scored_tokens": settings.scored_tokens,
            "new_tokens": settings.new_tokens,
            "speed_rounds": settings.speed_rounds,
            "speed_steps": settings.speed_steps,
            "prompt_count": settings.prompt_count,
            **inputs,
        },
        "measures": measures,
        "rows": rows,
        "absent": list(absent),
    }
