"""kvbench.passkey on a fake word-level model: trials are deterministic and sized, the needle is
there once, exact-match scoring, resuming skips finished pairs, bad inputs raise CompareError."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from kvbench.passkey import (
    ANSWER_TOKENS,
    NEEDLE,
    PASSKEY_SCHEMA,
    build_trials,
    filler_lines,
    passkey_result,
    read_answer,
    run_passkey,
    score_trial,
)
from kvbench.protocol import Candidate
from kvbench.results import CompareError
from test_kvbench import recording_context


class WordTokenizer:
    """One token per whitespace-separated word (``pieces`` > 1: a word is cut into that many
    tokens' worth of characters, to mimic subword tokenizers)."""

    def __init__(self, chars_per_token: int | None = None):
        self.chars = chars_per_token
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def _id(self, word: str) -> int:
        if word not in self.ids:
            self.ids[word] = len(self.words)
            self.words.append(word)
        return self.ids[word]

    def encode(self, text: str) -> list[int]:
        out = []
        for word in text.split():
            if self.chars is None:
                out.append(self._id(word))
            else:  # the word's pieces; the last carries the whole word so decoding stays simple
                extra = math.ceil(len(word) / self.chars) - 1
                out += [self._id("")] * extra + [self._id(word)]
        return out

    def decode(self, tokens) -> str:
        return " ".join(w for w in (self.words[t] for t in tokens) if w)


class FakeRunner:
    """A 'model' that answers with the passkey it can read in its cache.

    The history is the cache's words; after the last "The pass key is" it continues with the
    needle's number and "Remember it." when a needle "The pass key is NNNNN." is in the history,
    and with "I do not know" otherwise.
    """

    peak_label = "fake"
    kv_itemsize = 1

    def __init__(self, tokenizer: WordTokenizer):
        self.tok = tokenizer
        self.prefills: list[int] = []
        self.steps = 0

    def _logits(self, cache) -> np.ndarray:
        words = [self.tok.words[t] for t in cache.history()]
        ends = [i + 4 for i in range(len(words) - 3) if words[i : i + 4] == ["The", "pass", "key", "is"]]
        said = words[ends[-1] :] if ends else []
        keys = [words[i] for i in ends if i < len(words) and re.fullmatch(r"\d{5}\.", words[i])]
        plan = [keys[0], "Remember", "it."] if keys else ["I", "do", "not", "know"]
        word = plan[len(said)] if len(said) < len(plan) else "."
        z = np.zeros(len(self.tok.words) + 1)
        z[self.tok.encode(word)[-1]] = 1.0
        return z

    def prefill(self, cache, tokens):
        self.prefills.append(len(tokens))
        cache.add(tokens)
        return self._logits(cache)

    def step(self, cache, token):
        self.steps += 1
        cache.add([token])
        return self._logits(cache)

    def detokenize(self, tokens) -> str:
        return self.tok.decode(tokens)


class FakeCache:
    """Keeps every token; ``forget_digits`` stores every word holding a digit as '?'."""

    def __init__(self, tok: WordTokenizer, forget_digits: bool = False):
        self.tok, self.forget = tok, forget_digits
        self.tokens: list[int] = []

    def add(self, tokens):
        self.tokens += [int(t) for t in tokens]

    def history(self):
        if not self.forget:
            return self.tokens
        unknown = self.tok.encode("?")[0]
        return [unknown if re.search(r"\d", self.tok.words[t]) else t for t in self.tokens]


def cands(tok, events=None, baseline_forgets=False):
    ctx = recording_context(events)
    return [
        Candidate("baseline", "baseline", "keeps all", lambda: FakeCache(tok, baseline_forgets)),
        Candidate(
            "forgets",
            "tier",
            "drops digits",
            lambda: FakeCache(tok, True),
            context=ctx if events is not None else None,
        ),
        Candidate("exact-peer", "peer", "keeps all", lambda: FakeCache(tok)),
    ]


@pytest.fixture
def tok():
    return WordTokenizer()


# --------------------------------------------------------------------------- trials
def test_trials_are_deterministic_from_the_seed():
    a = build_trials(WordTokenizer().encode, 512, 6, seed=3)
    b = build_trials(WordTokenizer().encode, 512, 6, seed=3)
    assert [(t.text, t.passkey, t.depth) for t in a] == [(t.text, t.passkey, t.depth) for t in b]
    assert [t.tokens for t in a] == [t.tokens for t in b]
    c = build_trials(WordTokenizer().encode, 512, 6, seed=4)
    assert [t.passkey for t in c] != [t.passkey for t in a]
    assert all(10_000 <= t.passkey <= 99_999 for t in a + c)


@pytest.mark.parametrize("chars", [None, 4])
@pytest.mark.parametrize("length", [256, 1024, 2048])
def test_prompt_fills_the_length_within_a_few_tokens(length, chars):
    tok = WordTokenizer(chars)
    for trial in build_trials(tok.encode, length, 4, seed=1):
        budget = length - ANSWER_TOKENS  # the answer tokens fit in the length too
        assert budget - 8 <= len(trial.tokens) <= budget
        if chars is None:  # one token a word: the fit is exact
            assert len(trial.tokens) == budget


def test_the_needle_is_the_only_number_and_appears_once():
    for trial in build_trials(WordTokenizer().encode, 1024, 5, seed=0):
        needle = NEEDLE.format(key=trial.passkey)
        assert trial.text.count(needle) == 1
        assert re.findall(r"\d+", trial.text) == [str(trial.passkey)] * 2  # twice inside the needle
        assert trial.text.rstrip().endswith("What is the pass key? The pass key is")


def test_depths_spread_over_the_filler_and_the_needle_lands_there():
    trials = build_trials(WordTokenizer().encode, 2048, 5, seed=0)
    assert [t.depth for t in trials] == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])
    shares = [t.needle_token / len(t.tokens) for t in trials]
    assert shares == sorted(shares)
    assert all(abs(s - t.depth) < 0.05 for s, t in zip(shares, trials, strict=True))
    assert all(t.needle_token < t.question_token < len(t.tokens) for t in trials)


def test_template_wraps_the_user_message_before_the_answer_prefix():
    tok = WordTokenizer()
    trials = build_trials(tok.encode, 512, 2, template=lambda u: f"<user>\n{u}\n<assistant>\n")
    for t in trials:
        assert t.text.startswith("<user>\nThere is important information")
        assert t.text.endswith("What is the pass key?\n<assistant>\nThe pass key is")
        assert len(t.tokens) == 512 - ANSWER_TOKENS


def test_filler_lines_drop_digits():
    lines = filler_lines()
    assert lines and not any(re.search(r"\d", line) for line in lines)
    assert filler_lines("a 1\n\nb c\n") == ["b c"]


# --------------------------------------------------------------------------- scoring
@pytest.mark.parametrize(
    ("text", "want"),
    [
        (" 71432.\n", 71432),
        (" 71432 Remember", 71432),
        (" 714321", None),  # six digits are not the five asked for
        (" 7143", None),
        (" 1234 then 56789 and 71432", 56789),  # the first 5-digit number counts
        ("", None),
    ],
)
def test_read_answer_takes_the_first_five_digit_number(text, want):
    assert read_answer(text) == want


def test_score_trial_exact_match_and_the_question_is_fed_by_steps(tok):
    runner = FakeRunner(tok)
    trial = build_trials(tok.encode, 512, 1, seed=2)[0]
    base, forgets, _ = cands(tok)
    ok, answer = score_trial(runner, base, trial)
    assert ok and answer.startswith(f"{trial.passkey}.")
    assert runner.prefills == [trial.question_token]
    assert runner.steps == len(trial.tokens) - trial.question_token + ANSWER_TOKENS - 1
    ok, answer = score_trial(runner, forgets, trial)
    assert not ok and answer.startswith("I do not know")


def test_run_passkey_rows_and_baseline_beside_each(tok):
    events: list[str] = []
    got: list[dict] = []
    rows = run_passkey(
        FakeRunner(tok), cands(tok, events), tok.encode, [256, 512], 4, 0, False, on_result=got.append
    )
    assert [(r["name"], r["length"]) for r in rows] == [
        (n, length) for length in (256, 512) for n in ("baseline", "forgets", "exact-peer")
    ]
    assert got == rows  # each pair reported as it finished, in order
    by = {(r["name"], r["length"]): r for r in rows}
    for length in (256, 512):
        assert by[("baseline", length)]["accuracy"] == 1.0 and by[("baseline", length)]["correct"] == 4
        assert by[("forgets", length)]["accuracy"] == 0.0 and by[("forgets", length)]["kept"] == 0
        assert by[("exact-peer", length)]["kept"] == 4
        assert all(r["baseline_accuracy"] == 1.0 and r["baseline_retrieves"] for r in rows)
        assert all(r["note"] is None for r in rows)
    assert events == ["enter", "exit"] * 2  # the context wraps each of the tier's pairs


def test_a_length_the_baseline_cannot_do_is_marked(tok):
    rows = run_passkey(FakeRunner(tok), cands(tok, baseline_forgets=True), tok.encode, [256], 3, 0, False)
    assert all(r["baseline_accuracy"] == 0.0 and not r["baseline_retrieves"] for r in rows)
    assert all("does not test the cache" in r["note"] for r in rows)
    assert {r["name"]: r["accuracy"] for r in rows}["exact-peer"] == 1.0


# --------------------------------------------------------------------------- resuming
def test_resume_skips_finished_pairs(tok):
    first = run_passkey(FakeRunner(tok), cands(tok), tok.encode, [256, 512], 3, 0, False)
    runner = FakeRunner(tok)
    again = run_passkey(runner, cands(tok), tok.encode, [256, 512], 3, 0, False, done=first)
    assert again == first and runner.prefills == []  # nothing ran again
    # only the baseline at 256 finished before: the rest runs, compared with that baseline's hits
    runner, reported = FakeRunner(tok), []
    base = {("baseline", 256): first[0]}
    rows = run_passkey(
        runner, cands(tok), tok.encode, [256, 512], 3, 0, False, on_result=reported.append, done=base
    )
    assert [(r["name"], r["length"]) for r in reported] == [
        ("forgets", 256),
        ("exact-peer", 256),
        ("baseline", 512),
        ("forgets", 512),
        ("exact-peer", 512),
    ]
    assert len(runner.prefills) == 5 * 3
    assert [r["accuracy"] for r in rows] == [r["accuracy"] for r in first]
    assert rows[1]["baseline_accuracy"] == 1.0


def test_a_stopped_pair_resumes_at_its_next_trial(tok):
    class Stop(Exception):
        pass

    seen: list[dict] = []

    def stop_after_two(row):
        seen.append(row)
        if len(row["hits"]) == 2:
            raise Stop

    with pytest.raises(Stop):
        run_passkey(FakeRunner(tok), cands(tok), tok.encode, [256], 4, 0, False, on_trial=stop_after_two)
    assert [len(r["hits"]) for r in seen] == [1, 2] and all(r["partial"] for r in seen)
    runner = FakeRunner(tok)
    rows = run_passkey(runner, cands(tok), tok.encode, [256], 4, 0, False, done=[seen[-1]])
    assert len(runner.prefills) == 2 + 4 + 4  # the baseline's last two trials, then the others
    assert rows[0]["correct"] == 4 and "partial" not in rows[0]
    whole = run_passkey(FakeRunner(tok), cands(tok), tok.encode, [256], 4, 0, False)

    def timeless(rs):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rs]

    assert timeless(rows) == timeless(whole)  # as if it had never stopped


def test_resume_refuses_rows_of_another_run(tok):
    first = run_passkey(FakeRunner(tok), cands(tok), tok.encode, [256], 3, 0, False)
    with pytest.raises(CompareError, match="different runs do not mix"):
        run_passkey(FakeRunner(tok), cands(tok), tok.encode, [256], 4, 0, False, done=first)
    short = {**first[0], "hits": first[0]["hits"][:2], "answers": first[0]["answers"][:2]}
    with pytest.raises(CompareError, match="different runs do not mix"):  # short but not partial
        run_passkey(FakeRunner(tok), cands(tok), tok.encode, [256], 3, 0, False, done=[short])
    with pytest.raises(CompareError, match="not a passkey row"):
        run_passkey(FakeRunner(tok), cands(tok), tok.encode, [256], 3, 0, False, done=[{"x": 1}])


def test_result_document(tok):
    rows = run_passkey(FakeRunner(tok), cands(tok), tok.encode, [256], 2, 0, False)
    doc = passkey_result(
        tool="t", packages=["numpy"], model={"name": "fake"}, settings={"trials": 2}, rows=rows
    )
    assert doc["schema"] == PASSKEY_SCHEMA and doc["stamp"]["versions"]["numpy"] == np.__version__
    assert doc["rows"] == rows and "baseline_accuracy" in doc["measures"]
    with pytest.raises(CompareError):
        passkey_result(tool="t", packages=[], model={}, settings={}, rows=[{"x": 1}])


# --------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([0], "positive integer"),
        ([-1024], "positive integer"),
        (["1024"], "positive integer"),
        ([True], "positive integer"),
        ([1024.0], "positive integer"),
        (1024, "list of positive integers"),
        ("1024", "list of positive integers"),
        ([], "empty"),
        ([256, 256], "repeat"),
    ],
)
def test_bad_lengths(tok, lengths, message):
    with pytest.raises(CompareError, match=message):
        run_passkey(FakeRunner(tok), cands(tok), tok.encode, lengths, 2, 0, False)


@pytest.mark.parametrize("trials", [0, -1, True, 2.5, "20"])
def test_bad_trials(tok, trials):
    with pytest.raises(CompareError, match="trials"):
        run_passkey(FakeRunner(tok), cands(tok), tok.encode, [256], trials, 0, False)


def test_bad_candidates_and_callables(tok):
    runner = FakeRunner(tok)
    with pytest.raises(CompareError, match="non-empty"):
        run_passkey(runner, [], tok.encode, [256], 2, 0, False)
    with pytest.raises(CompareError, match="first candidate must be the baseline"):
        run_passkey(runner, cands(tok)[1:], tok.encode, [256], 2, 0, False)
    with pytest.raises(CompareError, match="Candidates"):
        run_passkey(runner, ["baseline"], tok.encode, [256], 2, 0, False)
    twice = cands(tok)[:1] * 2
    with pytest.raises(CompareError, match="repeat"):
        run_passkey(runner, twice, tok.encode, [256], 2, 0, False)
    with pytest.raises(CompareError, match="on_result"):
        run_passkey(runner, cands(tok), tok.encode, [256], 2, 0, False, on_result=3)
    with pytest.raises(CompareError, match="encode"):
        build_trials("not callable", 256, 2)
    with pytest.raises(CompareError, match="encode must return"):
        build_trials(lambda text: "abc", 256, 2)
    with pytest.raises(CompareError, match="template must return a str"):
        build_trials(tok.encode, 256, 2, template=lambda u: None)
    with pytest.raises(CompareError, match="seed"):
        build_trials(tok.encode, 256, 2, seed=-1)


def test_a_length_too_short_for_the_prompt(tok):
    with pytest.raises(CompareError, match="give a longer length"):
        build_trials(tok.encode, 30, 1)
