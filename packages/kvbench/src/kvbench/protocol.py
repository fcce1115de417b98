"""The side-by-side measuring protocol, shared by ``palu-mlx compare`` and ``flashcodec compare``.

The two commands differ only in how they load a model and build caches; the protocol is decided
here, once, so their results are comparable. :func:`measure` runs it for every candidate cache
(the uncompressed baseline, each tier of a package, each peer cache of its stack) through a
:class:`Runner` the framework provides, and returns one row per candidate with every figure
measured in that run.

Per candidate (``windows`` are token windows of held-out text):

1. **quality**, window by window, every candidate in turn on the same window: a fresh cache, one
   prefill call on the window's first ``context_tokens`` tokens, then the rest fed one token per
   call (teacher-forced decoding: every scored prediction reads the compressed history exactly as
   generation would). At every scored position the candidate's next-token distribution is
   compared with the baseline's at the same position: KL(baseline || candidate), whether the
   top-1 tokens agree, and the NLL of the true token. The cache's bytes (held and resident) are
   read after the first window; peak memory is read for the prefill and for the decode steps
   (the decode peak counts from before the cache existed, so it includes what the cache holds);
2. **greedy samples**: for each prompt, prefill and ``new_tokens`` greedy tokens: token match
   with the baseline illustrates, it does not rank;
3. **memory curve** (optional ``memory_points``): a fresh cache prefilled chunk by chunk up to each
   point, held and resident bytes read at each;
4. **speed**, after every candidate went through 1-3: ``speed_rounds`` rounds, each visiting every
   candidate in turn: a fresh cache, one timed prefill of a window's context, ``speed_steps``
   timed one-token calls. The best round counts (machine load only ever adds time).

Only numpy and the standard library are imported; tqdm is imported when used.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np

from .checks import check_count, check_token_lists
from .errors import CompareError

__all__ = [
    "MEASURES",
    "KVBytes",
    "Runner",
    "Candidate",
    "Settings",
    "text_windows",
    "log_softmax",
    "measure",
]

#: what each measured column means (copied into every result, so a JSON file explains itself)
MEASURES: dict[str, str] = {
    "kv_bytes": "bytes the cache held after the first window (context + scored tokens): its compressed "
    "representation, summed from the arrays' .nbytes",
    "kv_resident_bytes": "bytes of every array the cache object keeps after the first window: held bytes "
    "plus spare capacity, decoded views and raw tails (None where the cache cannot tell them apart: "
    "then resident = held)",
    "kv_raw_bytes": "bytes the uncompressed baseline cache held for exactly the same tokens, in the "
    "run's dtype (its K/V arrays cut to the tokens held, no spare capacity)",
    "kv_ratio": "kv_bytes / kv_raw_bytes (below 1: fewer bytes than the uncompressed cache needs)",
    "resident_ratio": "kv_resident_bytes (or kv_bytes) / kv_raw_bytes",
    "kv_ratio_decode_mean": "mean held bytes / mean raw bytes over the decode positions of the first window "
    "(after the prefill and after each scored token): a cache whose size jumps (a raw window flushed into "
    "codes every N tokens, capacity grown in steps) is charged its average, not one phase of its cycle",
    "resident_ratio_decode_mean": "the same mean for resident bytes (or held where the cache cannot tell "
    "them apart)",
    "bits_per_element": "8 * kv_bytes / number of K/V elements held (the uncompressed cache spends its "
    "dtype's width, e.g. 16)",
    "kl_mean": "mean KL(baseline || candidate) in nats of the next-token distributions at every scored "
    "position, same teacher-forced history",
    "kl_p99": "99th percentile of the per-position KL",
    "top1_agreement": "share of scored positions whose most likely next token equals the baseline's",
    "positions_scored": "number of scored positions (windows x scored tokens)",
    "nll": "mean negative log-likelihood (nats/token) of the true next token at the scored positions",
    "perplexity": "exp(nll)",
    "ppl_delta": "perplexity - baseline perplexity, same tokens, same run",
    "ppl_delta_ci95": "95% interval of ppl_delta from a paired bootstrap over the scored positions "
    "(each resample draws positions with replacement and scores both caches on them): how far "
    "ppl_delta moves with the positions sampled; two caches whose intervals overlap widely are not "
    "told apart by perplexity in this run",
    "ppl_vs_peers": "tiers only: per peer of the run, {ppl_delta, ci95}: this tier's perplexity minus "
    "the peer's on the same positions, and its 95% interval from the same paired bootstrap: the tier "
    "and the peer are told apart by perplexity only when the interval excludes 0 (whether two "
    "ppl_delta_ci95 intervals overlap does not answer that question)",
    "token_match": "share of greedy tokens equal to the baseline's at the same position (all prompts): "
    "an illustration; kl_mean and top1_agreement rank",
    "first_divergence": "mean index of the first greedy token that differs from the baseline "
    "(new_tokens when none differs)",
    "peak_prefill_bytes": "peak memory during the prefill call above the level before the cache was "
    "made (max over windows)",
    "peak_decode_bytes": "peak memory during the one-token calls above the level before the cache was "
    "made, so it includes what the cache holds (max over windows)",
    "memory_curve": "held and resident bytes after a chunked prefill up to each of memory_points tokens",
    "decode_tokens_per_s": "1 / median seconds of a one-token call, over speed_steps calls after prefilling "
    "a window's context; best of speed_rounds rounds that visit every cache in turn",
    "decode_speed_ratio": "decode_tokens_per_s / baseline decode_tokens_per_s (above 1: faster)",
    "prefill_seconds": "seconds of the prefill call on a window's context, best of the same rounds",
    "prefill_time_ratio": "prefill_seconds / baseline prefill_seconds (above 1: slower)",
}

#: "reference": a row that is no cache to choose but a yardstick, e.g. the noise floor (the same
#: model computed in float32): shown beside the others, never ranked against them
_KINDS = ("baseline", "tier", "peer", "reference")


@dataclass(frozen=True)
class KVBytes:
    """Bytes a cache held: ``held`` (its compressed representation) and, where the cache can tell
    them apart, ``resident`` (everything it keeps: held plus spare capacity and decoded views)."""

    held: int
    resident: int | None = None

    def __post_init__(self) -> None:
        check_count("KVBytes.held", self.held)
        if self.resident is not None:
            check_count("KVBytes.resident", self.resident)


class Runner(Protocol):
    """What a framework provides to :func:`measure` (one model, one tokenizer, batch 1).

    ``prefill`` and ``step`` must finish their computation before returning (they return numpy
    logits, which forces it), so the wall time around them is the compute time.
    """

    #: what the peak columns measure, in words (goes into the JSON and the table footer)
    peak_label: str
    #: bytes of one element of the uncompressed cache (2 for a 16-bit model)
    kv_itemsize: int

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
        """Start a peak-memory window: the current level becomes the base peaks are measured from."""
        ...

    def restart_peak(self) -> None:
        """Forget the high-water mark so far but keep the base of :meth:`reset_peak`."""
        ...

    def peak_bytes(self) -> int | None:
        """High-water mark since the last (re)start, above the base (None when not measurable)."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``."""
        ...


@dataclass(frozen=True)
class Candidate:
    """One cache to compare: ``make_cache()`` returns a fresh cache for the runner.

    ``context``: an optional context-manager factory entered around each of this candidate's
    runs (e.g. a patch of the model that must not touch the other candidates). ``details``: an
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
        if not isinstance(self.name, str) or not self.name.strip():
            raise CompareError(f"Candidate name must be a non-empty string; got {self.name!r}")
        if self.kind not in _KINDS:
            raise CompareError(f"Candidate {self.name!r}: kind={self.kind!r}; allowed: {', '.join(_KINDS)}")
        if not callable(self.make_cache):
            raise CompareError(
                f"Candidate {self.name!r}: make_cache must be callable; got {self.make_cache!r:.80}"
            )
        for attr in ("context", "details"):
            value = getattr(self, attr)
            if value is not None and not callable(value):
                raise CompareError(
                    f"Candidate {self.name!r}: {attr} must be None or callable; got {value!r:.80}"
                )
        if not isinstance(self.config, dict):
            raise CompareError(
                f"Candidate {self.name!r}: config must be a dict; got {type(self.config).__name__}"
            )


@dataclass(frozen=True)
class Settings:
    """How much text each candidate sees (see the module docstring for the protocol)."""

    windows: int = 16
    context_tokens: int = 192
    scored_tokens: int = 128
    new_tokens: int = 32
    speed_rounds: int = 3
    speed_steps: int = 16
    prompt_count: int = 2
    memory_points: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in COUNT_SETTINGS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CompareError(f"--{name.replace('_', '-')}={value!r} must be a positive integer")
        if self.prompt_count > self.windows:
            raise CompareError(
                f"--prompt-count={self.prompt_count} must not exceed --windows={self.windows} "
                "(default prompts are the windows' contexts)"
            )
        points = self.memory_points
        if not isinstance(points, (tuple, list)):
            raise CompareError(f"memory_points={points!r} must be a tuple of increasing positive integers")
        object.__setattr__(self, "memory_points", tuple(points))
        if any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in points) or list(
            points
        ) != sorted(set(points)):
            raise CompareError(f"memory_points={points!r} must be increasing positive integers")
        if points and points[-1] > self.window_tokens:
            raise CompareError(
                f"memory_points reach {points[-1]} tokens but a window has {self.window_tokens}"
            )

    @property
    def window_tokens(self) -> int:
        return self.context_tokens + self.scored_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "windows": self.windows,
            "context_tokens": self.context_tokens,
            "scored_tokens": self.scored_tokens,
            "new_tokens": self.new_tokens,
            "speed_rounds": self.speed_rounds,
            "speed_steps": self.speed_steps,
            "prompt_count": self.prompt_count,
            "memory_points": list(self.memory_points),
        }


#: the settings that count something (every ``int`` field of :class:`Settings`): each at least 1
COUNT_SETTINGS = tuple(f.name for f in fields(Settings) if f.type == "int")


def text_windows(tokens: Sequence[int], settings: Settings) -> list[list[int]]:
    """``settings.windows`` non-overlapping windows of ``window_tokens`` tokens, spread evenly
    over ``tokens`` (first window at the start). Raises CompareError when the text is too short."""
    if not isinstance(settings, Settings):
        raise CompareError(f"settings must be a kvbench Settings; got {type(settings).__name__}")
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise CompareError(f"tokens must be a sequence of token ids; got {type(tokens).__name__}")
    n, length = settings.windows, settings.window_tokens
    if len(tokens) < n * length:
        raise CompareError(
            f"--text has {len(tokens)} tokens; {n} windows of {length} tokens "
            f"(context + scored tokens) need {n * length}: pass a longer text or fewer/shorter windows"
        )
    stride = (len(tokens) - length) // (n - 1) if n > 1 else 0
    return [list(tokens[i * stride : i * stride + length]) for i in range(n)]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of ``logits [..., V]``, computed in float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


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


@dataclass
class _Tally:
    """What one candidate accumulates over the windows of the quality phase."""

    kl: list[np.ndarray] = field(default_factory=list)
    agree: int = 0
    nll: float = 0.0
    # per scored position, in order (the baseline's and a candidate's are paired by position)
    nll_positions: list[float] = field(default_factory=list)
    scored: int = 0
    peak_prefill: int | None = None
    peak_decode: int | None = None
    kv: KVBytes | None = None
    raw: int | None = None
    # (held, resident or held, raw) sums over the decode positions of the first window
    decode_bytes: tuple[int, int, int] = (0, 0, 0)
    seconds: float = 0.0

    def peak(self, which: str, value: int | None) -> None:
        if value is not None:
            old = getattr(self, which)
            setattr(self, which, value if old is None else max(old, value))


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
    with every ratio and divergence taken against the baseline row of this same run.
    """
    if not isinstance(settings, Settings):
        raise CompareError(f"settings must be a kvbench Settings; got {type(settings).__name__}")
    if not candidates or not all(isinstance(c, Candidate) for c in candidates):
        raise CompareError(f"candidates must be a non-empty list of Candidate; got {candidates!r:.80}")
    if candidates[0].kind != "baseline":
        raise CompareError(
            f"the first candidate must be the baseline; got {candidates[0].name!r} ({candidates[0].kind})"
        )
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise CompareError(f"candidate names must be unique; got {names}")
    windows = check_token_lists("windows", windows, length=settings.window_tokens)
    prompts = check_token_lists("prompts", prompts)
    missing = [
        m
        for m in ("prefill", "step", "kv_bytes", "raw_bytes", "detokenize")
        if not callable(getattr(runner, m, None))
    ]
    if missing:
        raise CompareError(f"runner must provide the Runner methods; {type(runner).__name__} lacks {missing}")
    ctx = settings.context_tokens
    quality_steps = sum(len(w) - ctx for w in windows) + len(prompts) * settings.new_tokens
    speed_steps = settings.speed_rounds * settings.speed_steps
    bar = _Progress(total=(quality_steps + speed_steps) * len(candidates), enabled=progress)
    tallies = [_Tally() for _ in candidates]
    try:
        vocab = _warm_up(runner, candidates[0], windows[0][:ctx])
        for index, window in enumerate(windows):
            base_logp: np.ndarray | None = None
            for cand, tally in zip(candidates, tallies, strict=True):
                bar.start(f"window {index + 1}/{len(windows)}: {cand.name}")
                with _entered(cand):
                    logp = _score_window(runner, cand, window, ctx, tally, index == 0, vocab, bar)
                if base_logp is None:
                    base_logp = logp
                _compare(tally, base_logp, logp)
        generations = []
        for cand in candidates:
            bar.start(f"greedy: {cand.name}")
            with _entered(cand):
                generations.append(_greedy(runner, cand, prompts, settings.new_tokens, bar))
        curves = []
        for cand in candidates:
            with _entered(cand):
                curves.append(_memory_curve(runner, cand, windows[0], settings.memory_points))
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
    finally:
        bar.close()
    raw = tallies[0].raw
    base_raw = tallies[0].decode_bytes[2]
    elements = raw // runner.kv_itemsize if raw else None
    rows = []
    for i, (cand, tally) in enumerate(zip(candidates, tallies, strict=True)):
        kl = np.concatenate(tally.kl)
        nll = tally.nll / tally.scored
        held, resident = tally.kv.held, tally.kv.resident
        row = {
            "name": cand.name,
            "kind": cand.kind,
            "description": cand.description,
            "config": cand.config,
            "kv_tokens": len(windows[0]),
            "kv_bytes": int(held),
            "kv_resident_bytes": None if resident is None else int(resident),
            "kv_raw_bytes": raw,
            "kv_ratio": held / raw if raw else None,
            "resident_ratio": (held if resident is None else resident) / raw if raw else None,
            # the raw bytes are the baseline's at the same positions; held counts equal samples
            "kv_ratio_decode_mean": tally.decode_bytes[0] / base_raw if base_raw else None,
            "resident_ratio_decode_mean": tally.decode_bytes[1] / base_raw if base_raw else None,
            "bits_per_element": 8 * held / elements if elements else None,
            "kl_mean": float(kl.mean()),
            "kl_p99": float(np.quantile(kl, 0.99)),
            "top1_agreement": tally.agree / tally.scored,
            "positions_scored": tally.scored,
            "nll": nll,
            "perplexity": math.exp(nll),
            "peak_prefill_bytes": tally.peak_prefill,
            "peak_decode_bytes": tally.peak_decode,
            "memory_curve": curves[i],
            "sample": runner.detokenize(generations[i][0]),
            "quality_seconds": tally.seconds,
            # best round: contention only ever adds time, so the fastest round is the cleanest
            "decode_tokens_per_s": 1.0 / min(decode[i]),
            "prefill_seconds": min(prefill[i]),
            "decode_steps_timed": speed_steps,
        }
        row.update(_greedy_agreement(generations[i], generations[0], settings.new_tokens))
        if cand.details is not None:
            row["details"] = cand.details()
        rows.append(row)
    _add_ratios(rows)
    base_nll = np.asarray(tallies[0].nll_positions)
    nll = [np.asarray(tally.nll_positions) for tally in tallies]
    for row, positions in zip(rows, nll, strict=True):
        row["ppl_delta_ci95"] = ppl_delta_interval(base_nll, positions)
    peers = [
        (r["name"], r["perplexity"], positions)
        for r, positions in zip(rows, nll, strict=True)
        if r["kind"] == "peer"
    ]
    for row, positions in zip(rows, nll, strict=True):
        if row["kind"] == "tier":
            row["ppl_vs_peers"] = {
                name: {"ppl_delta": row["perplexity"] - ppl, "ci95": ppl_delta_interval(peer_nll, positions)}
                for name, ppl, peer_nll in peers
            }
    return rows


#: resamples of :func:`ppl_delta_interval` (seeded: a rerun gives the same interval)
BOOTSTRAP_RESAMPLES = 2000


def ppl_delta_interval(base_nll: np.ndarray, nll: np.ndarray, seed: int = 0) -> list[float]:
    """``[low, high]``: the 2.5% and 97.5% quantiles of ``exp(mean nll) - exp(mean base_nll)`` over
    :data:`BOOTSTRAP_RESAMPLES` resamples of the positions (the same positions for both). Any two
    caches of one run pair this way: ``base_nll`` is the baseline's or a peer's."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(base_nll), (BOOTSTRAP_RESAMPLES, len(base_nll)))
    deltas = np.exp(nll[idx].mean(axis=1)) - np.exp(base_nll[idx].mean(axis=1))
    return [float(np.quantile(deltas, 0.025)), float(np.quantile(deltas, 0.975))]


def _entered(cand: Candidate) -> AbstractContextManager[Any]:
    return cand.context() if cand.context is not None else nullcontext()


def _warm_up(runner: Runner, baseline: Candidate, tokens: Sequence[int], steps: int = 8) -> int:
    """Run the baseline once; returns the vocabulary size (the logits' length).

    First calls pay one-time costs (kernel selection, allocator growth, lazy imports) that
    would otherwise be charged to the baseline, which runs first.
    """
    cache = baseline.make_cache()
    logits = runner.prefill(cache, tokens)
    for _ in range(steps):
        logits = runner.step(cache, int(np.argmax(logits)))
    return len(logits)


def _score_window(runner, cand, window, ctx, tally: _Tally, first: bool, vocab: int, bar) -> np.ndarray:
    """Teacher-forced run of one window; returns the log-probabilities ``[scored, V]`` (float32)."""
    started = time.perf_counter()
    # allocated and written before the peak's base is read: a peak that reads process memory
    # must not charge the protocol's own record of the log-probabilities to the cache
    out = np.ones((len(window) - ctx, vocab), np.float32)  # ones, not empty: every page written
    runner.reset_peak()
    cache = cand.make_cache()
    logits = runner.prefill(cache, window[:ctx])
    tally.peak("peak_prefill", runner.peak_bytes())
    runner.restart_peak()
    for j, token in enumerate(window[ctx:]):
        logp = log_softmax(logits)
        tally.nll -= float(logp[token])
        tally.nll_positions.append(-float(logp[token]))
        out[j] = logp
        if first:  # the cache every scored position of this window reads (bytes are off the peak's clock)
            _sample_bytes(runner, cache, tally, cand.kind == "baseline")
        logits = runner.step(cache, int(token))
        bar.update()
    tally.peak("peak_decode", runner.peak_bytes())
    tally.scored += len(out)
    if first:
        tally.kv = runner.kv_bytes(cache)
        if cand.kind == "baseline":
            tally.raw = runner.raw_bytes(cache)
    del cache
    tally.seconds += time.perf_counter() - started
    return out


def _sample_bytes(runner: Runner, cache: Any, tally: _Tally, baseline: bool) -> None:
    kv = runner.kv_bytes(cache)
    raw = runner.raw_bytes(cache) if baseline else 0
    held, resident, raws = tally.decode_bytes
    tally.decode_bytes = (
        held + kv.held,
        resident + (kv.held if kv.resident is None else kv.resident),
        raws + raw,
    )


def _compare(tally: _Tally, base: np.ndarray, cand: np.ndarray) -> None:
    b, c = base.astype(np.float64), cand.astype(np.float64)
    # KL(p || q) = sum p (log p - log q); clipped at 0 against float rounding of equal rows
    tally.kl.append(np.maximum((np.exp(b) * (b - c)).sum(axis=-1), 0.0))
    tally.agree += int((b.argmax(axis=-1) == c.argmax(axis=-1)).sum())


def _greedy(runner, cand, prompts, new_tokens: int, bar) -> list[list[int]]:
    outs = []
    for prompt in prompts:
        cache = cand.make_cache()
        logits = runner.prefill(cache, prompt)
        out: list[int] = []
        for k in range(new_tokens):
            token = int(np.argmax(logits))
            out.append(token)
            bar.update()
            if k + 1 < new_tokens:
                logits = runner.step(cache, token)
        outs.append(out)
        del cache
    return outs


def _memory_curve(runner, cand, window, points: Sequence[int]) -> list[dict[str, int | None]]:
    cache = cand.make_cache()
    out, fed = [], 0
    for point in points:
        runner.prefill(cache, window[fed:point])
        fed = point
        kv = runner.kv_bytes(cache)
        out.append({"tokens": point, "held": int(kv.held), "resident": kv.resident})
    del cache
    return out


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
