"""kvbench's bad-input catalogue and property tests.

Every named bad input to a user-facing function raises :class:`kvbench.results.CompareError` (a
``KVSpecError`` and a ``ValueError``) whose message names the problem, and leaves what it was given
(a result document, a file on disk) exactly as it was. The property tests draw random documents and
random invalid settings: strict JSON round trips, and every invalid ``Settings`` is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbench.cli import check_positions, load_eval_text, load_prompts, parse_selection
from kvbench.protocol import Candidate, KVBytes, Settings, measure, text_windows
from kvbench.report import format_bytes, plot_comparison, render_markdown, render_table
from kvbench.results import (
    CompareError,
    build_result,
    read_json,
    run_of,
    text_digest,
    weights_digest,
    write_json,
)
from kvspec import KVSpecError
from test_kvbench import SETTINGS, TOKENS, ToyRunner, _result, candidates

settings.register_profile("kvbench-ci", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("kvbench-ci")


@pytest.fixture(scope="module")
def result():
    return _result()


def _file(ctx, name: str, data: bytes) -> Path:
    path = ctx.tmp / name
    path.write_bytes(data)
    return path


def existing_result(ctx) -> Path:
    return _file(ctx, "r.json", b'{"kept": true}\n')


def _windows():
    return text_windows(TOKENS, SETTINGS)


# name -> (target(ctx) or None, call(obj, ctx), message pattern)
CATALOGUE = {
    "settings-zero-windows": (
        None,
        lambda o, c: Settings(windows=0),
        "--windows=0 must be a positive integer",
    ),
    "settings-float-context": (None, lambda o, c: Settings(context_tokens=1.5), "--context-tokens=1.5"),
    "settings-memory-points-int": (
        None,
        lambda o, c: Settings(memory_points=5),
        "memory_points=5 must be a tuple",
    ),
    "settings-memory-points-unsorted": (None, lambda o, c: Settings(memory_points=(8, 4)), "increasing"),
    "candidate-bad-kind": (
        None,
        lambda o, c: Candidate("x", "oracle", "", lambda: None),
        "kind='oracle'; allowed",
    ),
    "candidate-empty-name": (
        None,
        lambda o, c: Candidate("", "tier", "", lambda: None),
        "name must be a non-empty string",
    ),
    "candidate-cache-not-callable": (
        None,
        lambda o, c: Candidate("x", "tier", "", None),
        "make_cache must be callable",
    ),
    "kvbytes-negative": (None, lambda o, c: KVBytes(held=-3), "KVBytes.held must be an integer >= 0; got -3"),
    "text-windows-string": (
        None,
        lambda o, c: text_windows("abc", SETTINGS),
        "tokens must be a sequence of token ids; got str",
    ),
    "text-windows-no-settings": (
        None,
        lambda o, c: text_windows(TOKENS, {"windows": 2}),
        "settings must be a kvbench Settings",
    ),
    "measure-baseline-second": (
        None,
        lambda o, c: measure(ToyRunner(), candidates()[::-1], _windows(), [[1]], SETTINGS, progress=False),
        "the first candidate must be the baseline",
    ),
    "measure-short-window": (
        None,
        lambda o, c: measure(
            ToyRunner(), candidates(), [w[:-1] for w in _windows()], [[1]], SETTINGS, progress=False
        ),
        r"windows\[0\] has 8 tokens; every one must have 9",
    ),
    "measure-no-prompts": (
        None,
        lambda o, c: measure(ToyRunner(), candidates(), _windows(), [], SETTINGS, progress=False),
        "prompts must be a non-empty list",
    ),
    "measure-not-a-runner": (
        None,
        lambda o, c: measure(object(), candidates(), _windows(), [[1]], SETTINGS, progress=False),
        "lacks",
    ),
    "check-positions-no-prompts": (
        None,
        lambda o, c: check_positions(10, SETTINGS, []),
        "prompts must be a non-empty list",
    ),
    "selection-not-a-string": (
        None,
        lambda o, c: parse_selection(3, ["a"], "--tiers"),
        "--tiers must be a comma-separated string",
    ),
    "text-digest-bytes": (None, lambda o, c: text_digest(b"x"), "text must be a str; got bytes"),
    "format-bytes-string": (None, lambda o, c: format_bytes("12"), "format_bytes takes a number"),
    "build-result-runs-dict": (
        None,
        lambda o, c: build_result(
            tool="t", packages=[], model={}, inputs={}, peak_label="", runs={"short": []}
        ),
        "runs must be a list",
    ),
    # objects that must not change
    "run-of-a-list": (
        lambda c: [{"name": "short"}],
        lambda o, c: run_of(o, "short"),
        "must be a compare document",
    ),
    "render-table-no-runs": (lambda c: {"runs": []}, lambda o, c: render_table(o), "has no 'runs' list"),
    "render-table-bad-sample-chars": (
        lambda c: copy.deepcopy(c.result),
        lambda o, c: render_table(o, sample_chars=-1),
        "sample_chars must be an integer >= 4",
    ),
    "render-markdown-unknown-column": (
        lambda c: copy.deepcopy(c.result["runs"][0]["rows"]),
        lambda o, c: render_markdown(o, ["cache", "speed!"]),
        r"unknown columns \['speed!'\]",
    ),
    "render-markdown-rows-not-dicts": (
        lambda c: [1, 2],
        lambda o, c: render_markdown(o),
        r"rows\[0\] must be a result row",
    ),
    "plot-row-without-name": (
        lambda c: {"runs": [{"name": "short", "rows": [{}]}]},
        lambda o, c: plot_comparison(o, c.tmp / "p.png"),
        "must be a result row",
    ),
    "read-json-directory": (lambda c: c.tmp, lambda o, c: read_json(o), "cannot be read"),
    "read-json-not-an-object": (
        lambda c: _file(c, "l.json", b"[1, 2]"),
        lambda o, c: read_json(o),
        "must hold a JSON object; got a list",
    ),
    "read-json-not-utf8": (
        lambda c: _file(c, "b.json", b"\xff\xfe{}"),
        lambda o, c: read_json(o),
        "is not UTF-8 text",
    ),
    "read-json-truncated": (
        lambda c: _file(c, "t.json", b'{"runs": ['),
        lambda o, c: read_json(o),
        "is not valid JSON",
    ),
    "write-json-unserializable-keeps-old-file": (
        existing_result,
        lambda o, c: write_json(o, {"x": object()}),
        "r.json.*cannot be written as JSON",
    ),
    "weights-digest-missing-dir": (
        lambda c: c.tmp,
        lambda o, c: weights_digest(o / "nope"),
        "weights directory .* does not exist",
    ),
    "prompts-file-not-utf8": (
        lambda c: _file(c, "p.txt", b"\xff\xfe\x00"),
        lambda o, c: load_prompts(None, str(o)),
        "is not UTF-8 text",
    ),
    "text-file-is-a-directory": (lambda c: c.tmp, lambda o, c: load_eval_text(str(o)), "no such file"),
}


def _snap(obj):
    if isinstance(obj, Path):
        folder = obj if obj.is_dir() else obj.parent
        return sorted((p.name, p.read_bytes()) for p in folder.iterdir() if p.is_file())
    return copy.deepcopy(obj)


def test_the_catalogue_is_long_enough():
    assert len(CATALOGUE) >= 30


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_bad_input(name, tmp_path, result):
    target, call, pattern = CATALOGUE[name]
    ctx = SimpleNamespace(tmp=tmp_path, result=result)
    obj = None if target is None else target(ctx)
    before = _snap(obj)
    with pytest.raises(CompareError, match=pattern) as info:
        call(obj, ctx)
    assert isinstance(info.value, KVSpecError) and isinstance(info.value, ValueError)
    assert _snap(obj) == before, f"{name}: the object changed although the call raised"


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@given(data=st.dictionaries(st.text(max_size=6), _JSON, max_size=5))
def test_write_then_read_is_strict_and_faithful(data, tmp_path_factory):
    path = tmp_path_factory.mktemp("json") / "r.json"
    back = read_json(write_json(path, data))

    def expected(value):  # non-finite floats become null; everything else is kept
        if isinstance(value, float):
            return value if np.isfinite(value) else None
        if isinstance(value, dict):
            return {k: expected(v) for k, v in value.items()}
        if isinstance(value, list):
            return [expected(v) for v in value]
        return value

    assert back == expected(data)
    # strict JSON: no NaN / Infinity literals (the words may still appear inside strings)
    json.loads(path.read_text(), parse_constant=lambda word: pytest.fail(f"non-strict JSON literal {word}"))
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary file left behind


#: every count the settings hold (the int fields)
_FIELDS = tuple(f.name for f in dataclasses.fields(Settings) if f.type == "int")


@given(
    field=st.sampled_from(_FIELDS),
    value=st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.text(max_size=3), st.none()),
)
def test_invalid_settings_are_always_refused(field, value):
    with pytest.raises(CompareError, match=f"--{field.replace('_', '-')}="):
        Settings(**{field: value})


# --------------------------------------------------------------------------- --model names and converted models
@pytest.mark.parametrize("model", ["", "   ", 5, 1.5, ["tiny-qwen3"], b"tiny-qwen3"])
def test_resolve_model_refuses_what_is_not_a_model_name(model):
    from kvbench.models import resolve_model

    with pytest.raises(
        CompareError, match=r"model must be a named model \(.*tiny-qwen3.*\), a local directory"
    ):
        resolve_model(model)


@pytest.mark.parametrize(
    "field, value",
    [
        ("source", ["wheel", "gguf"]),
        ("source", "abc"),
        ("weights_sha256", [1, 2]),
        ("weights_sha256", {"a": 3}),
    ],
)
def test_a_converted_model_whose_manifest_has_the_wrong_shape_is_named(tmp_path, field, value):
    from kvbench.model_store import MANIFEST, ModelFetchError, WheelGGUFModel, _check_converted

    spec = WheelGGUFModel(
        name="fake-model",
        distribution="fake-dist",
        version="1.0",
        wheel_sha256="0" * 64,
        member="fake_dist/model.gguf",
        gguf_sha256="1" * 64,
        description="a fake",
    )
    manifest = {"source": {"wheel_sha256": "0" * 64, "gguf_sha256": "1" * 64}, "weights_sha256": {}}
    manifest[field] = value
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    before = (tmp_path / MANIFEST).read_text()
    with pytest.raises(ModelFetchError, match=rf"{MANIFEST}: '{field}' must"):
        _check_converted(spec, tmp_path)
    assert (tmp_path / MANIFEST).read_text() == before
