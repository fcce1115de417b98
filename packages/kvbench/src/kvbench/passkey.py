"""The passkey (needle) retrieval check: can a cache give back one number hidden in long context?

Each trial is one prompt of a target length in tokens: a short instruction, filler text, one
needle sentence holding a random 5-digit passkey at some depth of the filler, and the question::

    There is important information hidden inside a lot of irrelevant text. Find it and memorize
    it. I will quiz you about it.
    <filler> The pass key is 71432. Remember it. 71432 is the pass key. <filler>
    What is the pass key? The pass key is

A candidate cache gets a fresh cache per trial, one prefill of the prompt up to the question, the
question's tokens one per call (so the answer reads the needle back from the cache, as stored:
see :func:`score_trial`) and a few greedy tokens (:data:`ANSWER_TOKENS`); the trial is correct when the first 5-digit number of the decoded text
is the passkey (exact match: no partial credit for 4 right digits). Every candidate of a length
sees the same prompts, and the uncompressed baseline's accuracy stands beside every row, so a
loss is read against what the model itself retrieves: where the baseline does not retrieve
(below :data:`BASELINE_FLOOR`), the row says so and the length does not test the cache.

Trials are built from a seed alone (:func:`build_trials`): the passkeys, where the filler starts
in the held-out text and the depths (spread evenly over 10%..90% of the filler) do not depend on
the model; the prompt is sized with the caller's tokenizer so that prompt plus answer tokens fill
the target length (within a few tokens: the filler is cut at a word).

Only numpy and the standard library are imported.
"""

from __future__ import annotations

import numbers
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .models import default_text_path
from .protocol import Candidate, Runner
from .results import CompareError, environment_stamp

__all__ = [
    "ANSWER_TOKENS",
    "BASELINE_FLOOR",
    "NEEDLE",
    "PASSKEY_MEASURES",
    "PASSKEY_SCHEMA",
    "Trial",
    "build_trials",
    "filler_lines",
    "passkey_result",
    "read_answer",
    "run_passkey",
    "score_trial",
]

INTRO = (
    "There is important information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it."
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
#: the start of the answer, given to the model so the next tokens are the number itself
ANSWER_PREFIX = "The pass key is"
#: greedy tokens decoded per trial: a 5-digit number and a little slack (digits may be split one a token)
ANSWER_TOKENS = 8
#: below this baseline accuracy a length is marked as one the model itself cannot do
BASELINE_FLOOR = 0.5
#: depths of the needle, as a share of the filler, spread evenly over the trials
DEPTH_RANGE = (0.1, 0.9)

PASSKEY_SCHEMA = "kvbench.passkey/1"

#: what each column of a passkey row means (copied into the result, so the file explains itself)
PASSKEY_MEASURES: dict[str, str] = {
    "length": "target context in tokens: prompt plus answer tokens (the prompt fills it to within a word)",
    "trials": "prompts at this length (the same prompts for every candidate)",
    "correct": "trials whose first 5-digit number in the greedy answer equals the passkey",
    "accuracy": "correct / trials",
    "baseline_accuracy": "the uncompressed baseline's accuracy on the same prompts",
    "baseline_retrieves": f"baseline_accuracy >= {BASELINE_FLOOR}: below it the model itself does not "
    "retrieve at this length, and the length does not test the cache",
    "kept": "trials this candidate and the baseline both got right (of the baseline's correct ones)",
    "hits": "per trial, whether it was correct (trial order: depths rising)",
    "answers": "per trial, the decoded greedy answer",
    "prompt_tokens": "[min, max] prompt tokens over the trials",
    "seconds": "wall time of the candidate's trials at this length",
    "note": "set when the baseline does not retrieve at this length",
    "partial": "only on a pair that was stopped: its first trials, resumed from there by a rerun",
}

_FIVE_DIGITS = re.compile(r"(?<!\d)\d{5}(?!\d)")


@dataclass(frozen=True)
class Trial:
    """One prompt: ``tokens`` (what the runner is fed), its ``passkey`` and needle depth."""

    length: int
    index: int
    passkey: int
    depth: float  # target share of the filler before the needle
    needle_token: int  # tokens before the needle sentence (where it actually landed)
    question_token: int  # tokens before the question: the prefill's share of the prompt
    text: str
    tokens: list[int]


# --------------------------------------------------------------------------- checks
def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise CompareError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


def _check_lengths(lengths: object) -> list[int]:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise CompareError(f"lengths must be a list of positive integers (tokens); got {lengths!r:.80}")
    out = [_check_positive("every length", n) for n in lengths]
    if not out:
        raise CompareError("lengths is empty: give at least one context length in tokens")
    if len(set(out)) != len(out):
        raise CompareError(f"lengths {out} repeat a length")
    return out


# --------------------------------------------------------------------------- trials
def filler_lines(text: str | None = None) -> list[str]:
    """Lines of ``text`` (default: kvbench's held-out text) usable as filler: non-empty, without
    digits, so the passkey is the only number in the prompt and the answer cannot come from the
    filler."""
    if text is None:
        text = Path(default_text_path()).read_text(encoding="utf-8")
    if not isinstance(text, str):
        raise CompareError(f"filler text must be a str; got {type(text).__name__}")
    lines = [" ".join(line.split()) for line in text.splitlines()]
    lines = [line for line in lines if line and not re.search(r"\d", line)]
    if not lines:
        raise CompareError("the filler text has no line without digits to fill a prompt with")
    return lines


def _render(user: str, template: Callable[[str], str] | None) -> str:
    if template is None:
        return f"{user} {ANSWER_PREFIX}"
    wrapped = template(user)
    if not isinstance(wrapped, str):
        raise CompareError(f"the prompt template must return a str; got {type(wrapped).__name__}")
    # the template ends where the assistant's turn begins; the answer's start follows it
    return wrapped + ANSWER_PREFIX


def _user_text(words: Sequence[str], starts: Sequence[bool], cut: int, needle: str) -> str:
    """Instruction, the filler's first ``len(words)`` words with ``needle`` before word ``cut``
    (a line start), and the question."""

    def join(part: Sequence[str], first: Sequence[bool]) -> str:
        pieces = []
        for i, (word, new_line) in enumerate(zip(part, first, strict=True)):
            pieces.append(("\n" if new_line else " ") + word if i else word)
        return "".join(pieces)

    before, after = join(words[:cut], starts[:cut]), join(words[cut:], starts[cut:])
    parts = [INTRO, before, needle, after, QUESTION]
    return "\n".join(p for p in parts if p)


def _encode(encode: Callable[[str], Sequence[int]], text: str) -> list[int]:
    tokens = encode(text)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise CompareError(f"encode must return a list of token ids; got {type(tokens).__name__}")
    return [int(t) for t in tokens]


def _depths(trials: int) -> list[float]:
    low, high = DEPTH_RANGE
    if trials == 1:
        return [(low + high) / 2]
    return [low + (high - low) * i / (trials - 1) for i in range(trials)]


def build_trials(
    encode: Callable[[str], Sequence[int]],
    length: int,
    trials: int,
    seed: int = 0,
    *,
    template: Callable[[str], str] | None = None,
    lines: Sequence[str] | None = None,
    answer_tokens: int = ANSWER_TOKENS,
) -> list[Trial]:
    """``trials`` prompts of ``length - answer_tokens`` tokens (or a word's tokens fewer).

    ``encode``: the model's tokenizer (str -> token ids; it adds whatever special tokens the
    model's prompts start with). ``template``: wraps the user's message into the model's chat
    prompt up to the start of the assistant's turn (None: plain text). ``lines``: filler (default
    :func:`filler_lines` of the held-out text). The passkeys, filler starts and depths depend on
    ``seed``, ``length`` and the trial index only.
    """
    length = _check_positive("length", length)
    trials = _check_positive("trials", trials)
    answer_tokens = _check_positive("answer_tokens", answer_tokens)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise CompareError(f"seed must be an integer >= 0; got {seed!r}")
    if not callable(encode):
        raise CompareError(f"encode must be a callable str -> token ids; got {encode!r:.80}")
    if template is not None and not callable(template):
        raise CompareError(f"template must be None or a callable str -> str; got {template!r:.80}")
    lines = filler_lines() if lines is None else [str(line) for line in lines if str(line).strip()]
    if not lines:
        raise CompareError("no filler lines given")
    budget = length - answer_tokens
    rng = np.random.default_rng([int(seed), length])
    keys = rng.integers(10_000, 100_000, trials)
    offsets = rng.integers(0, len(lines), trials)
    out = []
    for index, (key, offset, depth) in enumerate(zip(keys, offsets, _depths(trials), strict=True)):
        needle = NEEDLE.format(key=int(key))
        out.append(
            _fit_trial(encode, template, lines, int(offset), needle, budget, length, index, int(key), depth)
        )
    return out


def _fit_trial(encode, template, lines, offset, needle, budget, length, index, key, depth) -> Trial:
    """The longest filler (in words, from line ``offset`` on, wrapping around) whose prompt fits ``budget``."""
    words: list[str] = []
    starts: list[bool] = []
    line = offset

    def grow(count: int) -> None:
        nonlocal line
        while len(words) < count:
            split = lines[line % len(lines)].split()
            words.extend(split)
            starts.extend([True] + [False] * (len(split) - 1))
            line += 1

    def prompt(n: int) -> tuple[str, int]:
        # the needle goes at the line start nearest to the depth, so it never splits a sentence
        want = depth * n
        cut = min((i for i in range(n + 1) if i == n or starts[i]), key=lambda i: (abs(i - want), i))
        return _render(_user_text(words[:n], starts[:n], cut, needle), template), cut

    def size(n: int) -> int:
        return len(_encode(encode, prompt(n)[0]))

    if size(0) > budget:
        raise CompareError(
            f"length {length}: the instruction, needle and question alone take {size(0)} tokens "
            f"(with {length - budget} answer tokens); give a longer length"
        )
    # a word is one token or more with subword tokenizers; grow further for any other encode
    high = budget
    grow(high)
    while size(high) <= budget:
        if high >= 64 * budget:
            raise CompareError(f"length {length}: encode does not grow with the text; cannot size the prompt")
        high *= 2
        grow(high)
    low = 0  # size(low) <= budget < size(high): search the largest word count that fits
    while low < high:
        mid = (low + high + 1) // 2
        if size(mid) <= budget:
            low = mid
        else:
            high = mid - 1
    text, _ = prompt(low)
    tokens = _encode(encode, text)
    needle_token = len(_encode(encode, text[: text.index(needle)]))
    question_token = min(len(_encode(encode, text[: text.rindex(QUESTION)])), len(tokens) - 1)
    return Trial(length, index, key, depth, needle_token, max(1, question_token), text, tokens)


# --------------------------------------------------------------------------- scoring
def read_answer(text: str) -> int | None:
    """The first 5-digit number of ``text`` (digits not part of a longer number), or None."""
    found = _FIVE_DIGITS.search(text)
    return int(found.group()) if found else None


def score_trial(
    runner: Runner, candidate: Candidate, trial: Trial, answer_tokens: int = ANSWER_TOKENS
) -> tuple[bool, str]:
    """``(correct, decoded answer)``: a fresh cache, one prefill of the trial up to its question,
    the question one token per call, then greedy tokens.

    Feeding the question token by token makes every answer token read the filler and the needle
    back from the cache as it stores them: caches that compress what a prefill wrote (quantized
    caches do) still attend over the exact keys inside that prefill call, so a prefill of the
    whole prompt would pick the first digit before any compression could lose it.
    """
    cache = candidate.make_cache()
    split = trial.question_token
    logits = runner.prefill(cache, trial.tokens[:split])
    for token in trial.tokens[split:]:
        logits = runner.step(cache, token)
    out: list[int] = []
    for k in range(answer_tokens):
        token = int(np.argmax(logits))
        out.append(token)
        if k + 1 < answer_tokens:
            logits = runner.step(cache, token)
    del cache
    answer = runner.detokenize(out)
    return read_answer(answer) == trial.passkey, answer


def _prior_rows(done: object, trials: int) -> dict[tuple[str, int], dict[str, Any]]:
    """``done`` (rows from an earlier run, or a mapping ``(name, length) -> row``) keyed by pair;
    a row marked ``partial`` holds the first trials of a pair that was stopped."""
    if done is None:
        return {}
    rows = list(done.values()) if isinstance(done, Mapping) else done
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise CompareError(f"done must be earlier rows or a dict (name, length) -> row; got {done!r:.80}")
    out = {}
    for row in rows:
        if not isinstance(row, Mapping) or not isinstance(row.get("name"), str) or "length" not in row:
            raise CompareError(f"done holds {row!r:.80}: not a passkey row (a dict with name and length)")
        hits, answers = row.get("hits"), row.get("answers")
        if (
            row.get("trials") != trials
            or not isinstance(hits, list)
            or not isinstance(answers, list)
            or len(hits) != len(answers)
            or len(hits) > trials
            or (len(hits) < trials and not row.get("partial"))
        ):
            raise CompareError(
                f"done: the row of {row['name']!r} at {row['length']} tokens has {row.get('trials')!r} "
                f"trials; this run has {trials}: results of different runs do not mix"
            )
        out[(row["name"], int(row["length"]))] = dict(row)
    return out


def _finish(row: dict[str, Any], base_hits: list[bool]) -> dict[str, Any]:
    trials = row["trials"]
    base = sum(base_hits) / trials
    row["baseline_accuracy"] = base
    row["baseline_retrieves"] = base >= BASELINE_FLOOR
    row["kept"] = sum(a and b for a, b in zip(row["hits"], base_hits, strict=True))
    row["note"] = (
        None
        if row["baseline_retrieves"]
        else f"the uncompressed baseline retrieves {sum(base_hits)}/{trials} at {row['length']} tokens: "
        "the model cannot do this length, so it does not test the cache"
    )
    return row


def run_passkey(
    runner: Runner,
    candidates: Sequence[Candidate],
    encode: Callable[[str], Sequence[int]],
    lengths: Sequence[int],
    trials: int = 20,
    seed: int = 0,
    progress: bool = True,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    done: Iterable[Mapping[str, Any]] | Mapping[tuple[str, int], Mapping[str, Any]] | None = None,
    *,
    on_trial: Callable[[dict[str, Any]], None] | None = None,
    template: Callable[[str], str] | None = None,
    lines: Sequence[str] | None = None,
    answer_tokens: int = ANSWER_TOKENS,
) -> list[dict[str, Any]]:
    """Every candidate (baseline first) on the same ``trials`` prompts at each of ``lengths``.

    Returns one row per (candidate, length), lengths in the order given, candidates in theirs:
    ``{name, kind, length, trials, correct, accuracy, baseline_accuracy, ...}`` (see
    :data:`PASSKEY_MEASURES`). ``done``: rows of an earlier run with the same trials and seed;
    their pairs are not run again and their rows are returned as they were (the baseline's hits
    are what later rows are compared with). ``on_result(row)`` is called as each pair finishes,
    so a caller can write it to disk before the next starts.

    A pair of 20 long trials can take an hour on a slow machine; ``on_trial(row)`` is called after
    each trial with the pair's row so far (``"partial": True``, the hits and answers up to there).
    Given back in ``done``, such a row resumes its pair at the next trial.
    """
    if not isinstance(candidates, Sequence) or not candidates:
        raise CompareError("candidates must be a non-empty list, the baseline first")
    for cand in candidates:
        if not isinstance(cand, Candidate):
            raise CompareError(f"candidates must be kvbench Candidates; got {type(cand).__name__}")
    if candidates[0].kind != "baseline":
        raise CompareError(f"the first candidate must be the baseline; got {candidates[0].name!r}")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise CompareError(f"candidate names repeat: {names}")
    lengths = _check_lengths(lengths)
    trials = _check_positive("trials", trials)
    answer_tokens = _check_positive("answer_tokens", answer_tokens)
    for name, hook in (("on_result", on_result), ("on_trial", on_trial)):
        if hook is not None and not callable(hook):
            raise CompareError(f"{name} must be None or a callable; got {hook!r:.80}")
    prior = _prior_rows(done, trials)
    lines = filler_lines() if lines is None else lines
    baseline = candidates[0].name
    partial = {key: row for key, row in prior.items() if row.get("partial")}
    prior = {key: row for key, row in prior.items() if not row.get("partial")}
    rows = []
    for length in lengths:
        pending = [c for c in candidates if (c.name, length) not in prior]
        built = None
        if pending:
            started = time.perf_counter()
            built = build_trials(
                encode, length, trials, seed, template=template, lines=lines, answer_tokens=answer_tokens
            )
            if progress:
                print(
                    f"passkey {length} tokens: {trials} trials built in {time.perf_counter() - started:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
        for cand in candidates:
            key = (cand.name, length)
            if key in prior:
                rows.append(prior[key])
                continue
            row = _run_pair(runner, cand, built, length, answer_tokens, progress, partial.get(key), on_trial)
            base_hits = row["hits"] if cand.name == baseline else prior[(baseline, length)]["hits"]
            row = _finish(row, base_hits)
            prior[key] = row
            rows.append(row)
            if on_result is not None:
                on_result(row)
    return rows


def _run_pair(
    runner,
    cand: Candidate,
    built: list[Trial],
    length: int,
    answer_tokens: int,
    progress: bool,
    start: Mapping[str, Any] | None,
    on_trial,
):
    """The candidate on every trial of ``built`` after those ``start`` (a partial row) already holds."""
    hits = list(start["hits"]) if start else []
    answers = list(start["answers"]) if start else []
    earlier = float(start.get("seconds", 0.0)) if start else 0.0
    started = time.perf_counter()
    with cand.context() if cand.context is not None else nullcontext():
        for trial in built[len(hits) :]:
            ok, answer = score_trial(runner, cand, trial, answer_tokens)
            hits.append(ok)
            answers.append(answer)
            if on_trial is not None and len(hits) < len(built):
                on_trial(
                    {
                        "name": cand.name,
                        "kind": cand.kind,
                        "length": length,
                        "trials": len(built),
                        "partial": True,
                        "hits": list(hits),
                        "answers": list(answers),
                        "seconds": earlier + time.perf_counter() - started,
                    }
                )
    seconds = earlier + time.perf_counter() - started
    correct = sum(hits)
    if progress:
        print(
            f"  {cand.name:24s} {length:6d} tokens: {correct}/{len(built)} in {seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    row: dict[str, Any] = {
        "name": cand.name,
        "kind": cand.kind,
        "length": length,
        "trials": len(built),
        "correct": correct,
        "accuracy": correct / len(built),
        "hits": hits,
        "answers": answers,
        "prompt_tokens": [min(len(t.tokens) for t in built), max(len(t.tokens) for t in built)],
        "seconds": seconds,
    }
    if cand.details is not None:
        row["details"] = cand.details()
    return row


# --------------------------------------------------------------------------- result file
def passkey_result(
    *,
    tool: str,
    packages: Iterable[str],
    model: dict[str, Any],
    settings: dict[str, Any],
    rows: list[dict[str, Any]],
    absent: Sequence[dict[str, str]] = (),
) -> dict[str, Any]:
    """The ``kvbench.passkey/1`` document: stamp (machine, versions, date), model, settings (lengths,
    trials, seed, template, ...), what each column means, the rows and the candidates that could
    not run here."""
    if not isinstance(rows, list) or not all(isinstance(r, Mapping) and "name" in r for r in rows):
        raise CompareError("rows must be a list of passkey rows (dicts with a name)")
    return {
        "schema": PASSKEY_SCHEMA,
        "tool": tool,
        "stamp": environment_stamp(packages),
        "model": model,
        "settings": settings,
        "measures": PASSKEY_MEASURES,
        "rows": rows,
        "absent": list(absent),
    }
