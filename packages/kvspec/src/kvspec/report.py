"""Side-by-side comparison reports: one protocol, one JSON layout, one table, one chart.

``palu-mlx compare`` and ``flashcodec compare`` differ only in how they load a model and build
caches; everything a reader sees is decided here, once, so the two reports are comparable:

* :func:`measure` runs the same protocol for every candidate cache (the uncompressed baseline,
  each tier of a package, each peer cache of its stack) through a :class:`Runner` the framework
  provides, and returns one row per candidate with every figure measured in that run;
* :func:`build_result` stamps the rows with the machine, the package versions and the date
  (:func:`environment_stamp`) into the JSON layout ``kvspec.compare/1``, written by
  :func:`write_json`;
* :func:`render_table` (terminal), :func:`render_markdown` (docs) and :func:`plot_comparison`
  (PNG: storage ratio vs perplexity increase, and decode speed) read that layout back;
* :func:`add_common_arguments`, :func:`load_eval_text`, :func:`load_prompts` and
  :func:`run_cli` give both command lines the same options and the same one-line errors.

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

Only numpy and the standard library are imported; matplotlib and tqdm are imported when used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn, Protocol

import numpy as np

from .interface import KVSpecError

__all__ = [
    "SCHEMA",
    "MEASURES",
    "CompareError",
    "Candidate",
    "KVBytes",
    "Runner",
    "Settings",
    "environment_stamp",
    "to_jsonable",
    "write_json",
    "read_json",
    "text_windows",
    "text_digest",
    "weights_digest",
    "token_nll",
    "measure",
    "build_result",
    "render_table",
    "render_markdown",
    "plot_comparison",
    "format_bytes",
    "OneLineParser",
    "add_common_arguments",
    "parse_selection",
    "load_eval_text",
    "load_prompts",
    "default_text_path",
    "prepare_tokens",
    "check_positions",
    "require_matplotlib",
    "emit",
    "run_cli",
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


class CompareError(KVSpecError, ValueError):
    """A mistake in a compare command (bad path, unknown tier, unusable model): one clear line."""


# --------------------------------------------------------------------------- stamping and JSON
def environment_stamp(packages: Iterable[str]) -> dict[str, Any]:
    """Machine, Python, installed versions of ``packages`` (None if absent) and the UTC date."""
    versions: dict[str, str | None] = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "date": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            # other work on the machine slows the timing columns; this says how busy it was
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "versions": versions,
    }


def to_jsonable(value: Any) -> Any:
    """``value`` with numpy scalars / arrays as Python numbers / lists, paths as strings and
    non-finite floats as None (strict JSON has no NaN)."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        return to_jsonable(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented, strict JSON (parent folders created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_jsonable(data), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return out


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """Read a result written by :func:`write_json`; a missing or broken file is a CompareError."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CompareError(f"result file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as err:
        raise CompareError(f"result file {str(path)!r} is not valid JSON: {err}") from None


# --------------------------------------------------------------------------- protocol
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


def weights_digest(directory: str | os.PathLike) -> str | None:
    """sha256 over the ``*.safetensors`` files of a local model directory (sorted by name), so a
    result names the exact weights it was measured on; None when there are none."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def text_digest(text: str) -> str:
    """sha256 of ``text`` (UTF-8), recorded so a result names exactly what it was measured on."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- rendering
def format_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"n/a"``."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _fmt(value: Any, spec: str, none: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return none
    return format(value, spec)


#: (header, function of a row) for the terminal and markdown tables, in order
_COLUMNS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("cache", lambda r: r["name"]),
    ("kind", lambda r: r["kind"]),
    ("KV held", lambda r: format_bytes(r["kv_bytes"])),
    ("x raw", lambda r: _fmt(r["kv_ratio"], ".3f")),
    ("peak mem", lambda r: format_bytes(r["peak_memory_bytes"])),
    ("ppl", lambda r: _fmt(r["perplexity"], ".3f")),
    ("d ppl", lambda r: _fmt(r["ppl_delta"], "+.3f")),
    ("token match", lambda r: _fmt(100 * r["token_match"], ".1f") + "%"),
    ("decode x", lambda r: _fmt(r["decode_speed_ratio"], ".2f")),
    ("prefill x", lambda r: _fmt(r["prefill_time_ratio"], ".2f")),
]


def _header_line(result: dict[str, Any]) -> str:
    m, s, st = result["model"], result["settings"], result["stamp"]
    dims = f"{m.get('layers')} layers, {m.get('kv_heads')} KV heads x {m.get('head_dim')}"
    return (
        f"{result['tool']}: {m.get('name')} ({m.get('architecture')}, {dims}, {m.get('dtype')}) "
        f"on {s.get('device', 'cpu')}, {st['machine']['cpu_count']} CPUs; "
        f"{s['windows']} windows x ({s['context_tokens']} context + {s['scored_tokens']} scored) tokens, "
        f"{s.get('prompts', '?')} prompts x {s['new_tokens']} greedy tokens"
    )


def render_table(result: dict[str, Any], sample_chars: int = 72) -> str:
    """The result as a plain-text table for a terminal, with the absent peers and text samples."""
    headers = [h for h, _ in _COLUMNS]
    body = [[f(r) for _, f in _COLUMNS] for r in result["rows"]]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(headers)]
    left = {0, 1}

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [_header_line(result), "", line(headers), line(["-" * w for w in widths])]
    out += [line(row) for row in body]
    out.append("")
    out.append(f"peak mem: {result['measures']['peak_memory_bytes']}")
    out.append(
        "x raw: KV bytes held / uncompressed KV bytes; decode x: tokens/s vs baseline (higher is faster);"
    )
    out.append("prefill x: prefill time vs baseline (higher is slower); all ratios from this one run.")
    for item in result.get("absent", []):
        out.append(f"absent: {item['name']} ({item['kind']}): {item['reason']}")
    out.append("")
    out.append("greedy continuation of prompt 1:")
    name_width = max(len(r["name"]) for r in result["rows"])
    for r in result["rows"]:
        sample = " ".join(r["sample"].split())
        if len(sample) > sample_chars:
            sample = sample[: sample_chars - 3] + "..."
        out.append(f"  {r['name'].ljust(name_width)}  {sample!r}")
    return "\n".join(out)


def render_markdown(result: dict[str, Any], columns: Sequence[str] | None = None) -> str:
    """The rows as a GitHub markdown table (``columns``: a subset of the table headers, in order)."""
    chosen = [(h, f) for h, f in _COLUMNS if columns is None or h in columns]
    if columns is not None and len(chosen) != len(columns):
        known = [h for h, _ in _COLUMNS]
        raise ValueError(f"unknown columns {sorted(set(columns) - set(known))}; known: {known}")
    lines = ["| " + " | ".join(h for h, _ in chosen) + " |"]
    lines.append("|" + "|".join("---" if h in ("cache", "kind") else "---:" for h, _ in chosen) + "|")
    for r in result["rows"]:
        lines.append("| " + " | ".join(f(r).replace("|", "\\|") for _, f in chosen) + " |")
    return "\n".join(lines)


def _log_height(y: float) -> float:
    # where a value sits on a symlog-like axis, for deciding whether two labels would collide
    return math.copysign(math.log10(1 + abs(y) * 1000), y)


_KIND_COLORS = {"baseline": "black", "tier": "tab:blue", "peer": "tab:orange"}


def plot_comparison(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write a PNG: storage ratio vs perplexity increase (one point per row), and decode speed bars.

    Needs matplotlib; without it raises CompareError saying how to install it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise CompareError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from None

    rows = result["rows"]
    fig, (ax_q, ax_s) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    deltas = [r["ppl_delta"] for r in rows]
    labels: dict[tuple[float, float], list[str]] = {}
    for r in rows:
        ax_q.scatter(r["kv_ratio"], r["ppl_delta"], color=_KIND_COLORS[r["kind"]], s=36, zorder=3)
        # rows on (nearly) the same spot share one label instead of overprinting each other
        y = r["ppl_delta"]
        key_y = round(y, 2) if abs(y) < 1 else float(f"{y:.2g}")
        labels.setdefault((round(r["kv_ratio"], 2), key_y + 0.0), []).append(r["name"])
    span = max(r["kv_ratio"] for r in rows) - min(r["kv_ratio"] for r in rows) or 1.0
    placed: list[tuple[float, float, bool]] = []
    for (x, y), names in sorted(labels.items()):
        # a label close to the previous one (in x, at a similar height) goes below its point instead
        near = [
            below
            for px, py, below in placed
            if x - px < 0.15 * span and abs(_log_height(y) - _log_height(py)) < 0.6
        ]
        below = bool(near) and not near[-1]
        placed.append((x, y, below))
        offset = (5, -11) if below else (5, 4)
        ax_q.annotate(" / ".join(names), (x, y), textcoords="offset points", xytext=offset, fontsize=8)
    ax_q.axhline(0.0, color="grey", lw=0.8)
    positive = [abs(d) for d in deltas if d]
    if positive and max(positive) / max(min(positive), 1e-12) > 100:
        # tiers can differ by orders of magnitude; a symlog axis keeps the small ones visible
        ax_q.set_yscale("symlog", linthresh=max(min(positive), 1e-3))
    ax_q.set_xlabel("KV bytes held / uncompressed KV bytes")
    ax_q.set_ylabel("perplexity increase over baseline")
    ax_q.set_title("storage vs quality (lower left is better)", fontsize=10)
    ax_q.grid(alpha=0.3)
    for kind, color in _KIND_COLORS.items():
        if any(r["kind"] == kind for r in rows):
            ax_q.scatter([], [], color=color, label=kind)
    ax_q.legend(fontsize=8, loc="upper right")

    names = [r["name"] for r in rows][::-1]
    speeds = [r["decode_speed_ratio"] for r in rows][::-1]
    ax_s.barh(names, speeds, color=[_KIND_COLORS[r["kind"]] for r in rows][::-1])
    ax_s.axvline(1.0, color="grey", lw=0.8)
    ax_s.set_xlabel("decode tokens/s relative to baseline")
    ax_s.set_title("decode speed (higher is faster)", fontsize=10)
    ax_s.tick_params(axis="y", labelsize=8)
    ax_s.grid(axis="x", alpha=0.3)
    m = result["model"]
    fig.suptitle(f"{result['tool']} on {m.get('name')} ({result['stamp']['date'][:10]})", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return out


# --------------------------------------------------------------------------- command line
HELDOUT_RELATIVE_PATH = Path("benchmarks") / "data" / "heldout.txt"


def default_text_path(cwd: Path | None = None) -> Path | None:
    """The repository's held-out text (``benchmarks/data/heldout.txt``) above ``cwd`` or this
    package, or None outside a checkout."""
    for start in (Path(cwd) if cwd is not None else Path.cwd(), Path(__file__).resolve().parent):
        for directory in (start.resolve(), *start.resolve().parents):
            candidate = directory / HELDOUT_RELATIVE_PATH
            if candidate.is_file():
                return candidate
    return None


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``error: ...``, exit code 2), like every
    other mistake the compare commands report."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def add_common_arguments(parser: argparse.ArgumentParser, tiers: Sequence[str], peers: Sequence[str]) -> None:
    """The options both compare commands share (model, text, prompts, selection, sizes, outputs)."""
    parser.add_argument(
        "--model",
        help="a local model directory or, with network access, a Hugging Face hub id "
        "(default: the repository's embedded tiny model)",
    )
    parser.add_argument(
        "--text",
        help="held-out text file for perplexity and default prompts (default: the repository's "
        f"{HELDOUT_RELATIVE_PATH.as_posix()})",
    )
    parser.add_argument(
        "--prompt", action="append", default=None, help="a prompt for greedy generation (repeatable)"
    )
    parser.add_argument("--prompts", help="file of prompts for greedy generation, one per non-empty line")
    parser.add_argument(
        "--tiers", help=f"comma-separated tiers (default: all): {', '.join(tiers)}; 'none' for no tier"
    )
    parser.add_argument(
        "--peers",
        help=f"comma-separated peer caches (default: all): {', '.join(peers)}; 'none' for no peer. "
        "A peer whose package is not installed is reported as absent, with the error",
    )
    parser.add_argument("--windows", type=int, default=Settings.windows, help="held-out windows (default 4)")
    parser.add_argument(
        "--context-tokens",
        type=int,
        default=Settings.context_tokens,
        help="prefilled tokens per window (default 192)",
    )
    parser.add_argument(
        "--scored-tokens",
        type=int,
        default=Settings.scored_tokens,
        help="teacher-forced, scored tokens per window after the context (default 64)",
    )
    parser.add_argument(
        "--new-tokens", type=int, default=Settings.new_tokens, help="greedy tokens per prompt (default 32)"
    )
    parser.add_argument(
        "--prompt-count",
        type=int,
        default=Settings.prompt_count,
        help="without --prompt/--prompts: greedy prompts taken from the first windows' contexts (default 2)",
    )
    parser.add_argument(
        "--speed-rounds",
        type=int,
        default=Settings.speed_rounds,
        help="round-robin timing rounds (default 3)",
    )
    parser.add_argument(
        "--speed-steps",
        type=int,
        default=Settings.speed_steps,
        help="timed one-token calls per round (default 16)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full result as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib)")
    parser.add_argument("--list", action="store_true", help="list the tiers and peers, then exit")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_selection(value: str | None, allowed: Sequence[str], option: str) -> list[str]:
    """Names chosen with ``--tiers`` / ``--peers`` (None: all; "none": none), in ``allowed`` order."""
    if value is None:
        return list(allowed)
    names = [v.strip() for v in value.split(",") if v.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise CompareError(
            f"{option}={value!r}: unknown name {', '.join(map(repr, unknown)) or '(empty)'}; "
            f"allowed: {', '.join(allowed)} or none"
        )
    return [n for n in allowed if n in names]


def load_eval_text(path: str | None) -> tuple[str, Path]:
    """The held-out text and where it came from (``--text`` or the repository default)."""
    if path is None:
        found = default_text_path()
        if found is None:
            raise CompareError(
                f"no evaluation text: pass --text FILE (the repository's {HELDOUT_RELATIVE_PATH.as_posix()} "
                "was not found above the working directory)"
            )
        file = found
    else:
        file = Path(path).expanduser()
        if not file.is_file():
            raise CompareError(f"--text {path!r}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CompareError(f"--text {str(file)!r} is not UTF-8 text") from None
    if not text.strip():
        raise CompareError(f"--text {str(file)!r} is empty")
    return text, file


def load_prompts(prompt: Sequence[str] | None, prompts_file: str | None) -> list[str] | None:
    """Prompts from ``--prompt`` (repeated) and ``--prompts FILE``; None when neither was given."""
    out = [p for p in (prompt or []) if p.strip()]
    if prompt and not out:
        raise CompareError("--prompt: every prompt given is empty")
    if prompts_file is not None:
        file = Path(prompts_file).expanduser()
        if not file.is_file():
            raise CompareError(f"--prompts {prompts_file!r}: no such file")
        lines = [ln for ln in file.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if not lines:
            raise CompareError(f"--prompts {prompts_file!r} has no non-empty line")
        out += lines
    return out or None


def prepare_tokens(
    encode_text: Callable[[str], list[int]],
    encode_prompt: Callable[[str], list[int]],
    text: str,
    prompt_texts: Sequence[str] | None,
    settings: Settings,
) -> tuple[list[list[int]], list[list[int]], str]:
    """``(windows, prompts, prompt_source)``: held-out windows of ``text`` and the greedy prompts
    (``prompt_texts`` encoded, or, when None, the context of each window)."""
    windows = text_windows(encode_text(text), settings)
    if prompt_texts is None:
        contexts = [w[: settings.context_tokens] for w in windows[: settings.prompt_count]]
        return windows, contexts, f"the context of the first {len(contexts)} windows"
    return windows, [encode_prompt(p) for p in prompt_texts], "--prompt / --prompts"


def check_positions(limit: int | None, settings: Settings, prompts: Sequence[Sequence[int]]) -> None:
    """CompareError when a window or a prompt plus its greedy tokens exceeds the model's ``limit``."""
    longest = max(settings.window_tokens, max(len(p) for p in prompts) + settings.new_tokens)
    if limit and longest > limit:
        raise CompareError(
            f"the run needs {longest} positions but the model allows {limit}: "
            "shorten --context-tokens / --scored-tokens / --new-tokens or the prompts"
        )


def require_matplotlib() -> None:
    """CompareError now (before minutes of measuring) when ``--plot`` cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CompareError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from None


def emit(result: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    """Print the table, then write the JSON and the chart where asked and say where they are."""
    print(render_table(result))
    if json_path:
        print(f"\nJSON: {write_json(json_path, result)}")
    if plot_path:
        print(f"chart: {plot_comparison(result, plot_path)}")


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Call ``main(argv)``; a kvspec error (a mistake the user can fix) prints one line
    ``error: ...`` to stderr and returns 2 instead of a traceback."""
    try:
        return main(argv)
    except KVSpecError as err:
        message = " ".join(str(err).split())
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except SystemExit as done:  # argparse: --help (0) or a bad option (2, already printed)
        return done.code if isinstance(done.code, int) else int(done.code is not None)
