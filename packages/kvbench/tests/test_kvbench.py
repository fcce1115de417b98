"""kvbench: the protocol on a toy numpy model (KL, top-1, bytes, peaks, memory curve), the result
document and its rendering, the command-line helpers and a whole ``run_compare`` through a toy
harness."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from datetime import datetime

import numpy as np
import pytest
from kvbench.cli import (
    Loaded,
    OneLineParser,
    add_common_arguments,
    check_positions,
    load_eval_text,
    load_prompts,
    long_settings,
    parse_selection,
    prepare_tokens,
    run_cli,
    run_compare,
)
from kvbench.models import default_text_path
from kvbench.protocol import Candidate, KVBytes, Settings, log_softmax, measure, text_windows
from kvbench.report import (
    format_bytes,
    frontier,
    plot_comparison,
    render_markdown,
    render_table,
    require_matplotlib,
)
from kvbench.results import (
    SCHEMA,
    CompareError,
    build_result,
    environment_stamp,
    read_json,
    run_of,
    write_json,
)
from kvspec import KVConfigError

VOCAB = 7


# --------------------------------------------------------------------------- a toy model
class ToyCache:
    """Holds the tokens it was fed; ``lossy`` stores every token rounded down to an even id."""

    def __init__(self, lossy: bool = False):
        self.lossy = lossy
        self.tokens: list[int] = []

    def add(self, tokens):
        self.tokens += list(tokens)

    def history(self):
        """What the model reads back: every token, or (lossy) every token rounded to an even id."""
        return [t - t % 2 for t in self.tokens] if self.lossy else self.tokens


def toy_logits(history: list[int]) -> np.ndarray:
    """A fixed 'model': the next token is likely (last + 1) % VOCAB, with a bias from the sum."""
    z = np.zeros(VOCAB)
    z[(history[-1] + 1) % VOCAB] += 3.0
    z[sum(history) % VOCAB] += 1.0
    return z


class ToyRunner:
    peak_label = "toy: the largest cache seen since the last (re)start, 8 bytes a token"
    kv_itemsize = 8

    def __init__(self):
        self.resets = self.restarts = 0
        self.high = 0

    def prefill(self, cache, tokens):
        cache.add(list(tokens))
        self.high = max(self.high, 8 * len(cache.tokens))
        return toy_logits(cache.history())

    def step(self, cache, token):
        cache.add([token])
        self.high = max(self.high, 8 * len(cache.tokens))
        return toy_logits(cache.history())

    def kv_bytes(self, cache):
        per = 1 if cache.lossy else 8
        return KVBytes(
            held=per * len(cache.tokens), resident=None if not cache.lossy else 2 * len(cache.tokens)
        )

    def raw_bytes(self, cache):
        return 8 * len(cache.tokens)

    def reset_peak(self):
        self.resets += 1
        self.high = 0

    def restart_peak(self):
        self.restarts += 1

    def peak_bytes(self):
        return self.high

    def detokenize(self, tokens):
        return " ".join(map(str, tokens))


def recording_context(events):
    """A candidate's ``context``: appends "enter" and "exit" to ``events`` around its measurement."""

    @contextlib.contextmanager
    def ctx():
        events.append("enter")
        yield
        events.append("exit")

    return ctx


def candidates(events=None):
    ctx = recording_context(events)
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


def scored_logits(windows, lossy):
    """The logits at every scored position, straight from the toy model (no protocol code)."""
    out = []
    for w in windows:
        cache = ToyCache(lossy)
        cache.add(w[:4])
        for tok in w[4:]:
            out.append(toy_logits(cache.history()))
            cache.add([tok])
    return np.array(out)


def softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def greedy(prompt, lossy, n):
    cache = ToyCache(lossy)
    cache.add(prompt)
    out = []
    for _ in range(n):
        tok = int(np.argmax(toy_logits(cache.history())))
        out.append(tok)
        cache.add([tok])
    return out


class FlushingRunner(ToyRunner):
    """A lossy cache that keeps up to 3 newest tokens at 8 bytes and the rest at 1 (a flushed window)."""

    def kv_bytes(self, cache):
        if not cache.lossy:
            return super().kv_bytes(cache)
        raw = len(cache.tokens) % 4
        return KVBytes(held=8 * raw + (len(cache.tokens) - raw))


def test_ppl_delta_interval_is_paired_and_seeded():
    from kvbench.protocol import ppl_delta_interval

    rng = np.random.default_rng(1)
    base = rng.uniform(2.5, 3.5, 4000)
    shifted = base + 0.01  # the same positions, every one 0.01 nats worse: no sampling noise left
    low, high = ppl_delta_interval(base, shifted)
    want = math.exp(shifted.mean()) - math.exp(base.mean())
    assert low <= want <= high and high - low < 0.05 * want
    noisy = base + rng.normal(0.01, 0.5, 4000)  # the same mean shift, independent noise per position
    low2, high2 = ppl_delta_interval(base, noisy)
    assert high2 - low2 > 10 * (high - low) and ppl_delta_interval(base, noisy) == [low2, high2]


def test_tiers_are_compared_with_each_peer_on_the_same_positions():
    windows = text_windows(TOKENS, SETTINGS)
    cands = [
        *candidates(),
        Candidate("exact-peer", "peer", "what the baseline does", lambda: ToyCache()),
        Candidate("even-peer", "peer", "what the tier does", lambda: ToyCache(lossy=True)),
    ]
    base, even, exact, same = measure(ToyRunner(), cands, windows, [[1, 2]], SETTINGS, progress=False)
    assert "ppl_vs_peers" not in base and "ppl_vs_peers" not in exact
    vs = even["ppl_vs_peers"]
    assert list(vs) == ["exact-peer", "even-peer"]
    # a peer that predicts what the baseline predicts: the tier's own ppl_delta and interval
    assert vs["exact-peer"]["ppl_delta"] == pytest.approx(even["ppl_delta"])
    assert vs["exact-peer"]["ci95"] == even["ppl_delta_ci95"]
    # a peer that predicts what the tier predicts: paired, every resample's difference is 0
    assert vs["even-peer"] == {"ppl_delta": 0.0, "ci95": [0.0, 0.0]}


def test_decode_mean_charges_a_cache_whose_size_jumps_its_average():
    windows = text_windows(TOKENS, SETTINGS)
    rows = measure(FlushingRunner(), candidates(), windows, [[1, 2], [5]], SETTINGS, progress=False)
    held = [8 * (n % 4) + n - n % 4 for n in range(4, 9)]  # 4..8 tokens at the 5 scored positions
    raw = [8 * n for n in range(4, 9)]
    assert rows[1]["kv_ratio_decode_mean"] == pytest.approx(sum(held) / sum(raw))
    assert rows[1]["resident_ratio_decode_mean"] == rows[1]["kv_ratio_decode_mean"]  # no resident: held
    assert rows[1]["kv_ratio"] == pytest.approx((8 * 1 + 8) / 72)  # 9 tokens at the end: one flush behind


def test_measure_rows_follow_the_protocol():
    events: list[str] = []
    runner = ToyRunner()
    windows = text_windows(TOKENS, SETTINGS)
    prompts = [[1, 2], [5]]
    rows = measure(runner, candidates(events), windows, prompts, SETTINGS, progress=False)
    base, even = rows
    assert [r["name"] for r in rows] == ["baseline", "even"]
    targets = np.array([t for w in windows for t in w[4:]])
    z_base, z_even = scored_logits(windows, False), scored_logits(windows, True)
    p, q = softmax(z_base), softmax(z_even)
    idx = np.arange(len(targets))
    assert base["nll"] == pytest.approx(-np.log(p[idx, targets]).mean())
    assert even["nll"] == pytest.approx(-np.log(q[idx, targets]).mean())
    kl = (p * (np.log(p) - np.log(q))).sum(axis=-1)
    assert kl.max() > 0.01  # the toy's rounding does change predictions
    assert even["kl_mean"] == pytest.approx(kl.mean(), rel=1e-5)
    assert even["kl_p99"] == pytest.approx(np.quantile(kl, 0.99), rel=1e-5)
    assert even["top1_agreement"] == pytest.approx((p.argmax(-1) == q.argmax(-1)).mean())
    assert base["kl_mean"] == 0 and base["top1_agreement"] == 1
    assert even["positions_scored"] == len(targets) == 2 * 5
    assert even["perplexity"] == pytest.approx(math.exp(even["nll"]))
    assert even["ppl_delta"] == pytest.approx(even["perplexity"] - base["perplexity"])
    assert base["ppl_delta"] == 0 and base["token_match"] == 1 and base["decode_speed_ratio"] == 1
    # the bootstrap interval of ppl_delta: empty for the baseline, around the value for the candidate
    assert base["ppl_delta_ci95"] == [0.0, 0.0]
    low, high = even["ppl_delta_ci95"]
    assert low < even["ppl_delta"] < high and high - low > 0.01
    # bytes after the first window: 9 tokens; raw comes from the baseline; 8 bytes an element
    assert base["kv_bytes"] == base["kv_raw_bytes"] == even["kv_raw_bytes"] == 8 * 9
    assert even["kv_bytes"] == 9 and even["kv_ratio"] == pytest.approx(1 / 8)
    # averaged over the first window's decode positions (4..8 tokens held when each is scored)
    assert base["kv_ratio_decode_mean"] == pytest.approx(1.0)
    assert even["kv_ratio_decode_mean"] == pytest.approx(1 / 8)
    assert even["resident_ratio_decode_mean"] == pytest.approx(2 / 8)
    assert even["bits_per_element"] == pytest.approx(8.0) and base["bits_per_element"] == pytest.approx(64.0)
    assert even["kv_resident_bytes"] == 18 and base["kv_resident_bytes"] is None
    assert even["resident_ratio"] == pytest.approx(18 / 72) and base["resident_ratio"] == 1
    ours = [greedy(p, True, 6) for p in prompts]
    theirs = [greedy(p, False, 6) for p in prompts]
    same = sum(a == b for o, t in zip(ours, theirs, strict=True) for a, b in zip(o, t, strict=True))
    assert even["token_match"] == pytest.approx(same / 12)
    assert even["sample"] == " ".join(map(str, ours[0]))
    # peaks: prefill holds the 4 context tokens, decode reaches the 9 of a window
    assert even["peak_prefill_bytes"] == 8 * 4 and even["peak_decode_bytes"] == 8 * 9
    assert runner.resets == runner.restarts == 2 * 2  # a window each, per candidate
    assert even["memory_curve"] == []
    assert even["decode_steps_timed"] == 2 * 3  # speed rounds x timed steps
    # the context wraps each window, the greedy run, the memory curve and each speed round
    assert events == ["enter", "exit"] * (2 + 1 + 1 + 2) and even["details"] == {"events": 12}
    assert "details" not in base
    for row in rows:
        for key in ("decode_tokens_per_s", "prefill_seconds", "prefill_time_ratio", "quality_seconds"):
            assert math.isfinite(row[key]) and row[key] > 0


def test_memory_curve_reads_bytes_after_each_chunk():
    settings = Settings(
        windows=1, context_tokens=6, scored_tokens=2, new_tokens=1, prompt_count=1, memory_points=(2, 5, 8)
    )
    windows = text_windows(TOKENS, settings)
    rows = measure(ToyRunner(), candidates(), windows, [[1]], settings, progress=False)
    assert rows[0]["memory_curve"] == [
        {"tokens": 2, "held": 16, "resident": None},
        {"tokens": 5, "held": 40, "resident": None},
        {"tokens": 8, "held": 64, "resident": None},
    ]
    assert [p["resident"] for p in rows[1]["memory_curve"]] == [4, 10, 16]


@pytest.mark.parametrize("points", [(3, 2), (0, 4), (4, 4), (2, 99)])
def test_memory_points_are_checked(points):
    with pytest.raises(CompareError, match="memory_points"):
        Settings(windows=1, context_tokens=6, scored_tokens=2, prompt_count=1, memory_points=points)


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


def test_log_softmax_is_stable():
    z = np.array([1000.0, 1001.0, 999.0])
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    assert log_softmax(z) == pytest.approx(np.log(p))


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


MODEL = {"name": "toy", "architecture": "toy", "layers": 1, "kv_heads": 1, "head_dim": 1, "dtype": "int"}


def _result():
    windows = text_windows(TOKENS, SETTINGS)
    rows = measure(ToyRunner(), candidates(), windows, [[1, 2]], SETTINGS, progress=False)
    long = Settings(
        windows=1, context_tokens=30, scored_tokens=4, new_tokens=1, prompt_count=1, memory_points=(8, 34)
    )
    long_rows = measure(ToyRunner(), candidates(), text_windows(TOKENS, long), [[1]], long, progress=False)
    return build_result(
        tool="toy compare",
        packages=["numpy"],
        model=MODEL,
        inputs={"device": "cpu"},
        peak_label=ToyRunner.peak_label,
        runs=[
            {"name": "short", "settings": SETTINGS.as_dict(), "rows": rows},
            {"name": "long", "settings": long.as_dict(), "rows": long_rows},
        ],
        absent=[{"name": "other", "kind": "peer", "reason": "ImportError: not here"}],
    )


def test_build_result_layout_and_rendering():
    result = _result()
    assert result["schema"] == SCHEMA and result["measures"]["peak_label"] == ToyRunner.peak_label
    assert run_of(result, "short")["settings"]["windows"] == 2 and run_of(result, "nope") is None
    assert run_of(result, "long")["rows"][1]["memory_curve"][-1] == {"tokens": 34, "held": 34, "resident": 68}
    table = render_table(result)
    assert "baseline" in table and "even" in table and "ImportError: not here" in table
    assert "short context: 2 windows" in table and "long context: 1 windows" in table
    assert ToyRunner.peak_label in table
    rows = run_of(result, "short")["rows"]
    md = render_markdown(rows).splitlines()
    assert md[0].startswith("| cache | kind | bits/el |") and len(md) == 2 + 2
    short = render_markdown(rows, columns=["cache", "held x"]).splitlines()
    assert short[0] == "| cache | held x |" and short[3] == "| even | 0.125 |"
    with pytest.raises(ValueError, match="unknown columns"):
        render_markdown(rows, columns=["cache", "bogus"])


def test_frontier_keeps_only_undominated_points():
    pts = [(4.0, 0.1, "a"), (2.0, 0.5, "b"), (3.0, 0.6, "c"), (8.0, 0.01, "d"), (2.0, 0.4, "e")]
    assert [name for _, _, name in frontier(pts)] == ["e", "a", "d"]


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


def test_default_text_ships_with_kvbench():
    text, path = load_eval_text(None)
    assert path == default_text_path() and path.parent.name == "data"
    assert 50_000 < len(text) < 400_000


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
    add_common_arguments(parser, ["a"], ["p"], ["float32"])
    assert run_cli(lambda argv: parser.parse_args(argv) and 0, ["--windows", "x"]) == 2
    err = capsys.readouterr().err
    assert err == "error: argument --windows: invalid int value: 'x' (see toy compare --help)\n"


def test_long_settings_fit_the_model():
    parser = OneLineParser(prog="toy")
    add_common_arguments(parser, ["a"], ["p"], ["float32"])
    args = parser.parse_args([])
    long = long_settings(args, limit=1024)
    assert long.window_tokens == 1024 and long.scored_tokens == 256
    assert long.memory_points == (256, 512, 1024)
    assert long_settings(parser.parse_args(["--no-memory-curve"]), 1024).memory_points == ()
    assert long_settings(parser.parse_args(["--long-context", "0"]), 1024) is None
    with pytest.raises(CompareError, match="must exceed --long-scored-tokens"):
        long_settings(parser.parse_args(["--long-context", "200"]), None)


# --------------------------------------------------------------------------- a whole compare
class ToyHarness:
    tool = "toy compare"
    packages = ("numpy",)
    dtypes = ("int",)

    def tiers(self):
        return {"even": "rounds to even ids"}

    def peers(self):
        return {"absent-peer": "never installed"}

    def add_arguments(self, parser):
        parser.add_argument("--device", default="cpu")

    def load(self, args: argparse.Namespace) -> Loaded:
        if args.model == "missing":
            raise CompareError("--model 'missing': no such model")
        return Loaded(
            runner=ToyRunner(),
            info=MODEL,
            encode_text=lambda text: [ord(c) % VOCAB for c in text],
            encode_prompt=lambda text: [ord(c) % VOCAB for c in text],
            max_positions=600,
        )

    def candidates(self, loaded, tiers, peers):
        cands = [c for c in candidates() if c.kind == "baseline" or c.name in tiers]
        absent = [{"name": p, "kind": "peer", "reason": "ImportError: not here"} for p in peers]
        return cands, absent


def test_run_compare_writes_both_runs(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--windows", "3", "--context-tokens", "8", "--scored-tokens", "4", "--speed-rounds", "1"]
    argv += ["--speed-steps", "2", "--new-tokens", "3", "--long-scored-tokens", "8", "--quiet"]
    assert run_cli(lambda a: run_compare(ToyHarness(), a), [*argv, "--json", str(out)]) == 0
    result = read_json(out)
    assert [r["name"] for r in result["runs"]] == ["short", "long"]
    long = run_of(result, "long")
    # the long run is capped at the model's 600 positions
    assert long["settings"]["context_tokens"] + long["settings"]["scored_tokens"] == 600
    assert [p["tokens"] for p in long["rows"][0]["memory_curve"]] == [256, 512, 600]
    assert result["inputs"]["device"] == "cpu" and result["absent"][0]["name"] == "absent-peer"
    assert "long context" in capsys.readouterr().out


def test_run_compare_errors_are_one_line(capsys):
    assert run_cli(lambda a: run_compare(ToyHarness(), a), ["--model", "missing", "--quiet"]) == 2
    assert capsys.readouterr().err == "error: --model 'missing': no such model\n"
    assert run_cli(lambda a: run_compare(ToyHarness(), a), ["--tiers", "bogus"]) == 2
    assert "unknown name 'bogus'" in capsys.readouterr().err
    assert run_cli(lambda a: run_compare(ToyHarness(), a), ["--list"]) == 0
    assert "tier  even" in capsys.readouterr().out
