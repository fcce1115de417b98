"""The compare modules: the protocol on a toy numpy model (kvspec.measure), JSON stamping
(kvspec.results), rendering (kvspec.report) and the command-line helpers (kvspec.compare_cli)."""

from __future__ import annotations

import json
import math
import sys
from datetime import datetime

import numpy as np
import pytest
from kvspec import KVConfigError
from kvspec.compare_cli import (
    OneLineParser,
    add_common_arguments,
    check_positions,
    default_text_path,
    load_eval_text,
    load_prompts,
    parse_selection,
    prepare_tokens,
    run_cli,
)
from kvspec.measure import (
    SCHEMA,
    Candidate,
    KVBytes,
    Settings,
    build_result,
    measure,
    text_windows,
    token_nll,
)
from kvspec.report import format_bytes, plot_comparison, render_markdown, render_table, require_matplotlib
from kvspec.results import CompareError, environment_stamp, read_json, write_json

VOCAB = 7


# --------------------------------------------------------------------------- a toy model
class ToyCache:
    """Holds the tokens it was fed; ``lossy`` stores every token rounded down to an even id."""

    def __init__(self, lossy: bool = False):
        self.lossy = lossy
        self.tokens: list[int] = []

    def add(self, tokens):
        self.tokens += [t - t % 2 if self.lossy else t for t in tokens]


def toy_logits(history: list[int]) -> np.ndarray:
    """A fixed 'model': the next token is likely (last + 1) % VOCAB, with a bias from the sum."""
    z = np.zeros(VOCAB)
    z[(history[-1] + 1) % VOCAB] += 3.0
    z[sum(history) % VOCAB] += 1.0
    return z


class ToyRunner:
    peak_label = "toy: tokens held x 8 bytes"

    def __init__(self):
        self.resets = 0

    def prefill(self, cache, tokens):
        cache.add(list(tokens))
        return toy_logits(cache.tokens)

    def step(self, cache, token):
        cache.add([token])
        return toy_logits(cache.tokens)

    def kv_bytes(self, cache):
        per = 1 if cache.lossy else 8
        return KVBytes(
            held=per * len(cache.tokens), resident=None if not cache.lossy else 2 * len(cache.tokens)
        )

    def raw_bytes(self, cache):
        return 8 * len(cache.tokens)

    def reset_peak(self):
        self.resets += 1

    def peak_bytes(self):
        return 1234

    def detokenize(self, tokens):
        return " ".join(map(str, tokens))


def candidates(events=None):
    import contextlib

    @contextlib.contextmanager
    def ctx():
        events.append("enter")
        yield
        events.append("exit")

    return [
        Candidate("baseline", "baseline", "exact", lambda: ToyCache()),
        Candidate(
            "even",
            "tier",
            "rounds to even ids",
            lambda: ToyCache(lossy=True),
            {"lossy": True},
            context=ctx if events is not None else None,
            details=(lambda: {"events": len(events)}) if events is not None else None,
        ),
    ]


SETTINGS = Settings(
    windows=2, context_tokens=4, scored_tokens=5, new_tokens=6, speed_rounds=2, speed_steps=3, prompt_count=2
)
TOKENS = [(3 * i + i // 4) % VOCAB for i in range(40)]


def expected_nll(windows, lossy):
    total, n = 0.0, 0
    for w in windows:
        cache = ToyCache(lossy)
        cache.add(w[:4])
        for tok in w[4:]:
            total += token_nll(toy_logits(cache.tokens), tok)
            n += 1
            cache.add([tok])
    return total / n


def greedy(prompt, lossy, n):
    cache = ToyCache(lossy)
    cache.add(prompt)
    out = []
    for _ in range(n):
        tok = int(np.argmax(toy_logits(cache.tokens)))
        out.append(tok)
        cache.add([tok])
    return out


def test_measure_rows_follow_the_protocol():
    events: list[str] = []
    runner = ToyRunner()
    windows = text_windows(TOKENS, SETTINGS)
    prompts = [[1, 2], [5]]
    rows = measure(runner, candidates(events), windows, prompts, SETTINGS, progress=False)
    base, even = rows
    assert [r["name"] for r in rows] == ["baseline", "even"]
    assert base["nll"] == pytest.approx(expected_nll(windows, False))
    assert even["nll"] == pytest.approx(expected_nll(windows, True))
    assert even["perplexity"] == pytest.approx(math.exp(even["nll"]))
    assert even["ppl_delta"] == pytest.approx(even["perplexity"] - base["perplexity"])
    assert base["ppl_delta"] == 0 and base["token_match"] == 1 and base["decode_speed_ratio"] == 1
    # bytes after the first window: 9 tokens; raw comes from the baseline
    assert base["kv_bytes"] == base["kv_raw_bytes"] == even["kv_raw_bytes"] == 8 * 9
    assert even["kv_bytes"] == 9 and even["kv_ratio"] == pytest.approx(1 / 8)
    assert even["kv_resident_bytes"] == 18 and base["kv_resident_bytes"] is None
    ours = [greedy(p, True, 6) for p in prompts]
    theirs = [greedy(p, False, 6) for p in prompts]
    same = sum(a == b for o, t in zip(ours, theirs, strict=True) for a, b in zip(o, t, strict=True))
    assert even["token_match"] == pytest.approx(same / 12)
    assert even["sample"] == " ".join(map(str, ours[0]))
    assert even["peak_memory_bytes"] == 1234 and runner.resets == 2
    assert even["decode_steps_timed"] == 2 * 3  # speed rounds x timed steps
    # the context wraps the quality run and each speed round; details are read at the end
    assert events == ["enter", "exit"] * 3 and even["details"] == {"events": 6} and "details" not in base
    for row in rows:
        for key in ("decode_tokens_per_s", "prefill_seconds", "prefill_time_ratio", "elapsed_seconds"):
            assert math.isfinite(row[key]) and row[key] > 0


def test_measure_needs_the_baseline_first():
    runner = ToyRunner()
    windows = text_windows(TOKENS, SETTINGS)
    with pytest.raises(ValueError, match="baseline"):
        measure(runner, candidates()[::-1], windows, [[1]], SETTINGS, progress=False)


def test_text_windows_are_spread_and_disjoint():
    tokens = list(range(100))
    windows = text_windows(tokens, Settings(windows=3, context_tokens=10, scored_tokens=10))
    assert [w[0] for w in windows] == [0, 40, 80] and all(len(w) == 20 for w in windows)
    with pytest.raises(CompareError, match="--text has 100 tokens"):
        text_windows(tokens, Settings(windows=6, context_tokens=10, scored_tokens=10))


@pytest.mark.parametrize(
    "field",
    [
        "windows",
        "context_tokens",
        "scored_tokens",
        "new_tokens",
        "speed_rounds",
        "speed_steps",
        "prompt_count",
    ],
)
def test_settings_reject_non_positive(field):
    with pytest.raises(CompareError, match=f"--{field.replace('_', '-')}=0"):
        Settings(**{field: 0})


def test_default_prompts_are_the_first_contexts():
    settings = Settings(windows=3, context_tokens=4, scored_tokens=2, prompt_count=2)
    windows, prompts, source = prepare_tokens(lambda t: list(range(30)), None, "x", None, settings)
    assert prompts == [w[:4] for w in windows[:2]] and source == "the context of the first 2 windows"
    _, prompts, source = prepare_tokens(lambda t: list(range(30)), lambda p: [len(p)], "x", ["ab"], settings)
    assert prompts == [[2]] and source == "--prompt / --prompts"
    with pytest.raises(CompareError, match="--prompt-count=4 must not exceed --windows=3"):
        Settings(windows=3, prompt_count=4)


def test_token_nll_is_a_stable_log_softmax():
    z = np.array([1000.0, 1001.0, 999.0])
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    assert token_nll(z, 1) == pytest.approx(-math.log(p[1]))


# --------------------------------------------------------------------------- JSON and stamping
def test_environment_stamp():
    stamp = environment_stamp(["numpy", "surely-not-installed-pkg"])
    assert stamp["versions"]["numpy"] == np.__version__
    assert stamp["versions"]["surely-not-installed-pkg"] is None
    assert datetime.fromisoformat(stamp["date"]).tzinfo is not None
    assert {"platform", "processor", "cpu_count", "python", "machine"} <= set(stamp["machine"])


def test_write_json_is_strict(tmp_path):
    path = write_json(tmp_path / "a" / "r.json", {"x": np.float32(1.5), "n": float("nan"), "a": np.arange(2)})
    text = path.read_text()
    assert json.loads(text) == {"x": 1.5, "n": None, "a": [0, 1]}
    assert "NaN" not in text
    assert read_json(path)["x"] == 1.5
    with pytest.raises(CompareError, match="does not exist"):
        read_json(tmp_path / "missing.json")


def _result():
    windows = text_windows(TOKENS, SETTINGS)
    rows = measure(ToyRunner(), candidates(), windows, [[1, 2]], SETTINGS, progress=False)
    return build_result(
        tool="toy compare",
        packages=["numpy"],
        model={
            "name": "toy",
            "architecture": "toy",
            "layers": 1,
            "kv_heads": 1,
            "head_dim": 1,
            "dtype": "int",
        },
        settings=SETTINGS,
        inputs={"prompts": 1, "device": "cpu"},
        peak_label=ToyRunner.peak_label,
        rows=rows,
        absent=[{"name": "other", "kind": "peer", "reason": "ImportError: not here"}],
    )


def test_build_result_layout_and_rendering():
    result = _result()
    assert result["schema"] == SCHEMA and result["measures"]["peak_memory_bytes"] == ToyRunner.peak_label
    assert result["settings"]["windows"] == 2 and result["settings"]["prompts"] == 1
    table = render_table(result)
    assert "baseline" in table and "even" in table and "ImportError: not here" in table
    assert ToyRunner.peak_label in table
    md = render_markdown(result).splitlines()
    assert md[0].startswith("| cache | kind |") and len(md) == 2 + 2
    short = render_markdown(result, columns=["cache", "x raw"]).splitlines()
    assert short[0] == "| cache | x raw |" and short[3] == "| even | 0.125 |"
    with pytest.raises(ValueError, match="unknown columns"):
        render_markdown(result, columns=["cache", "bogus"])


def test_plot_without_matplotlib_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(CompareError, match="pip install matplotlib"):
        plot_comparison(_result(), tmp_path / "c.png")
    with pytest.raises(CompareError, match="pip install matplotlib"):
        require_matplotlib()


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_comparison(_result(), tmp_path / "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_format_bytes():
    assert format_bytes(None) == "n/a"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 1024**2) == "3.0 MiB"


# --------------------------------------------------------------------------- command-line helpers
def test_parse_selection():
    allowed = ("a", "b", "c")
    assert parse_selection(None, allowed, "--tiers") == ["a", "b", "c"]
    assert parse_selection("none", allowed, "--tiers") == []
    assert parse_selection("c, a", allowed, "--tiers") == ["a", "c"]
    with pytest.raises(CompareError, match=r"--tiers='a,zz': unknown name 'zz'; allowed: a, b, c"):
        parse_selection("a,zz", allowed, "--tiers")


def test_text_and_prompt_files(tmp_path):
    with pytest.raises(CompareError, match="no such file"):
        load_eval_text(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(CompareError, match="is empty"):
        load_eval_text(str(tmp_path / "empty.txt"))
    (tmp_path / "p.txt").write_text("first\n\n  \nsecond\n")
    assert load_prompts(["zero"], str(tmp_path / "p.txt")) == ["zero", "first", "second"]
    assert load_prompts(None, None) is None
    with pytest.raises(CompareError, match="--prompts"):
        load_prompts(None, str(tmp_path / "missing.txt"))


def test_default_text_is_found_above_the_working_directory(tmp_path):
    heldout = tmp_path / "benchmarks" / "data" / "heldout.txt"
    heldout.parent.mkdir(parents=True)
    heldout.write_text("text")
    (tmp_path / "deep" / "er").mkdir(parents=True)
    assert default_text_path(cwd=tmp_path / "deep" / "er") == heldout


def test_check_positions():
    check_positions(None, SETTINGS, [[1] * 100])
    with pytest.raises(CompareError, match="needs 16 positions but the model allows 10"):
        check_positions(10, SETTINGS, [[1] * 10])


def test_run_cli_prints_one_line_and_exits_2(capsys):
    def bad(argv):
        raise KVConfigError("head_dim=3 is wrong;\n allowed: 64")

    assert run_cli(bad, []) == 2
    err = capsys.readouterr().err
    assert err == "error: head_dim=3 is wrong; allowed: 64\n"
    assert run_cli(lambda argv: 0, []) == 0


def test_one_line_parser_errors(capsys):
    parser = OneLineParser(prog="toy compare")
    add_common_arguments(parser, ["a"], ["p"])
    assert run_cli(lambda argv: parser.parse_args(argv) and 0, ["--windows", "x"]) == 2
    err = capsys.readouterr().err
    assert err == "error: argument --windows: invalid int value: 'x' (see toy compare --help)\n"
