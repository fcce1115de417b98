"""Bad input to palu-mlx's commands and loaders: a one-line error and a non-zero exit (never a
traceback), files whose conversation was edited are refused, prompt-cache files load in a fresh
process, and bad saved states or fit inputs raise kvspec errors that leave the cache unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

TESTS = Path(__file__).resolve().parent
MODEL = os.environ.get("KVBENCH_EMBEDDED_MODEL") or str(
    TESTS.parents[2] / "benchmarks" / "model" / "tiny-qwen3"
)
needs_model = pytest.mark.skipif(not os.path.isdir(MODEL), reason="the embedded model is not checked out")


def _python(code: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "palu_mlx.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# --------------------------------------------------------------------------- registration with mlx-lm
_ROUND_TRIP = """
import sys
sys.path.insert(0, sys.argv[2])
from mlx_lm.models import cache as mlx_cache
from cache_snapshots import build, kv, snapshot
from palu_mlx import KVCacheConfig, PaluKVCache, RotatingPaluKVCache

kind = sys.argv[3]
if kind == "rotating":
    cache = RotatingPaluKVCache(PaluKVCache(KVCacheConfig(head_dim=32, palu_min_fit_tokens=8)), max_size=16)
    cache.update_and_fetch(*kv(12, 1))
else:
    cache = build(kind)
before = snapshot(cache) if kind != "rotating" else None
mlx_cache.save_prompt_cache(sys.argv[1], [cache])
loaded = mlx_cache.load_prompt_cache(sys.argv[1])
assert type(loaded[0]) is type(cache), type(loaded[0])
assert loaded[0].offset == cache.offset
if before is not None:
    assert snapshot(loaded[0]) == before
print("round trip", type(loaded[0]).__name__)
"""


@pytest.mark.parametrize("kind", ["palu-fixed", "naive", "calibrated", "rotating"])
def test_a_cache_made_before_any_builder_call_round_trips_through_mlx_lms_files(tmp_path, kind):
    # a fresh process: nothing registered the classes before the cache was constructed
    proc = _python(_ROUND_TRIP, str(tmp_path / "cache.safetensors"), str(TESTS), kind)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "round trip" in proc.stdout


# --------------------------------------------------------------------------- generate --prompt-cache-file
def _generate(file: Path, prompt: str) -> subprocess.CompletedProcess:
    return _cli(
        "generate", "--model", MODEL, "--max-tokens", "4", "--palu-bits", "2",
        "--prompt-cache-file", str(file), "--prompt", prompt,
    )  # fmt: skip


@needs_model
def test_a_conversation_file_continues_in_a_second_process(tmp_path):
    file = tmp_path / "chat.safetensors"
    first = _generate(file, "The json module encodes Python objects as")
    assert first.returncode == 0, first.stderr[-2000:]
    second = _generate(file, "And one more?")
    assert second.returncode == 0, second.stderr[-2000:]
    _, meta = mx.load(str(file), return_metadata=True)
    messages = json.loads(meta[_key(meta, "palu_messages")])
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == "And one more?"


@pytest.fixture(scope="module")
def conversation(tmp_path_factory):
    if not os.path.isdir(MODEL):
        pytest.skip("the embedded model is not checked out")
    file = tmp_path_factory.mktemp("conversation") / "chat.safetensors"
    proc = _generate(file, "Say something about lists.")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return file.read_bytes()


@pytest.mark.parametrize(
    "name, content",
    [
        ("truncated", lambda good: good[: len(good) // 2]),
        ("not-safetensors", lambda good: b"this is not a safetensors file\n" * 4),
        ("empty", lambda good: b""),
    ],
)
def test_an_unreadable_prompt_cache_file_is_one_line_and_left_as_it_was(
    tmp_path, conversation, name, content
):
    file = tmp_path / "chat.safetensors"
    file.write_bytes(content(conversation))
    before = file.read_bytes()
    line = _one_line_error(_generate(file, "Hello?"))
    assert f"--prompt-cache-file {str(file)!r} cannot be loaded" in line
    assert file.read_bytes() == before


def _key(meta: dict[str, str], name: str) -> str:
    """The flattened safetensors key mlx-lm's save_prompt_cache gave the user metadata entry ``name``."""
    (key,) = [k for k in meta if k.partition(".")[2] == name]
    return key


def _edited(tmp_path: Path, good: bytes, key: str, value: str, keep_checksum: bool = True) -> Path:
    file = tmp_path / "chat.safetensors"
    file.write_bytes(good)
    arrays, meta = mx.load(str(file), return_metadata=True)
    prefix = _key(meta, "palu_messages").partition(".")[0] + "."
    meta[prefix + key] = value
    if not keep_checksum:
        from palu_mlx.generate import _conversation_digest

        texts = {k.removeprefix(prefix): v for k, v in meta.items() if k.startswith(prefix)}
        meta[prefix + "palu_checksum"] = _conversation_digest(texts)
    mx.save_safetensors(str(file), arrays, meta)
    return file


@pytest.mark.parametrize(
    "key, value",
    [
        ("palu_tokens", '["a", "b"]'),
        ("palu_tokens", "not json"),
        ("palu_messages", "{not json"),
        ("palu_messages", '[{"role": "user", "content": "edited"}]'),
        ("tokenizer_config", "[1, 2]"),
    ],
)
def test_an_edited_conversation_fails_its_checksum(tmp_path, conversation, key, value):
    file = _edited(tmp_path, conversation, key, value)
    before = file.read_bytes()
    line = _one_line_error(_generate(file, "Hello?"))
    assert "checksum mismatch" in line and "cannot be loaded" in line
    assert file.read_bytes() == before


def test_a_conversation_without_its_checksum_is_refused(tmp_path, conversation):
    file = tmp_path / "chat.safetensors"
    file.write_bytes(conversation)
    arrays, meta = mx.load(str(file), return_metadata=True)
    del meta[_key(meta, "palu_checksum")]
    mx.save_safetensors(str(file), arrays, meta)
    before = file.read_bytes()
    line = _one_line_error(_generate(file, "Hello?"))
    assert "cannot be loaded" in line and "has no 'palu_checksum' entry" in line
    assert file.read_bytes() == before


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("palu_tokens", '["a", "b"]', "'palu_tokens' must list token ids (integers >= 0); it holds 'a'"),
        ("palu_tokens", "[1, 2]", "'palu_tokens' lists 2 tokens but the cache holds"),
        ("palu_tokens", "{oops", "'palu_tokens' is not valid JSON"),
        ("palu_messages", "{oops", "'palu_messages' is not valid JSON"),
        (
            "palu_messages",
            "[3]",
            "'palu_messages' entry 0 must be an object with string 'role' and 'content'",
        ),
        ("tokenizer_config", "[1]", "'tokenizer_config' must be a JSON object; got list"),
    ],
)
def test_conversation_metadata_of_the_wrong_type_is_refused_even_with_a_matching_checksum(
    tmp_path, conversation, key, value, message
):
    file = _edited(tmp_path, conversation, key, value, keep_checksum=False)
    line = _one_line_error(_generate(file, "Hello?"))
    assert message in line


# --------------------------------------------------------------------------- saved states and fit inputs
@pytest.mark.parametrize("kind", ["palu-fixed", "naive", "calibrated"])
@pytest.mark.parametrize("dtype", ["foo", "int8", "", "__name__"])
def test_from_state_with_an_unknown_dtype_names_it(kind, dtype):
    from cache_snapshots import build
    from kvspec import KVDataError
    from palu_mlx.state_checks import STATE_META

    cache = build(kind)
    settings_json, runtime_json = cache.meta_state
    runtime = json.loads(runtime_json)
    runtime["dtype"] = dtype
    state = {k: v for k, v in cache.state.items() if k != STATE_META}
    with pytest.raises(
        KVDataError, match=rf"meta_state dtype={dtype!r} is not one of float16, bfloat16, float32"
    ):
        type(cache).from_state(state, (settings_json, json.dumps(runtime)))


def test_dtype_from_name_refuses_names_that_are_not_supported_dtypes():
    from kvspec import KVDtypeError
    from palu_mlx.layer import dtype_from_name

    assert dtype_from_name("bfloat16") == mx.bfloat16
    for name in ("foo", "array", "int8", None, 3):
        with pytest.raises(KVDtypeError, match="is not one of float16, bfloat16, float32"):
            dtype_from_name(name)


@pytest.mark.parametrize("kind", ["palu-fitted", "palu-fixed", "palu-pre-rope"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_fit_on_values_too_large_for_float32_statistics_is_refused_before_it_runs(kind, dtype):
    from cache_snapshots import KINDS, kv, snapshot
    from kvspec import KVValueError

    cache = KINDS[kind][0]()  # empty: the next 12 tokens reach the fit
    before = snapshot(cache)
    k, v = kv(12, 4, dtype)
    with pytest.raises(
        KVValueError, match=r"too large for the fit's float32 statistics .* allowed max \|x\| <= "
    ):
        cache.update_and_fetch(k * 1e30, v)
    assert snapshot(cache) == before and not cache.fitted


def test_fit_group_projection_refuses_values_too_large_for_float32_statistics():
    from cache_snapshots import kv
    from kvspec import KVValueError
    from palu_mlx import fit_group_projection

    k, _ = kv(12, 4)
    with pytest.raises(KVValueError, match="too large for the fit's float32 statistics"):
        fit_group_projection(k * 1e30, 1, 4)
    assert fit_group_projection(k * 1e6, 1, 4) is not None


# --------------------------------------------------------------------------- server
@pytest.mark.parametrize("model", ["{tmp}/no-such-model", "./no/such/model", "{tmp}/config.json"])
def test_server_with_a_missing_model_directory_is_one_line_before_serving(tmp_path, model):
    model = model.format(tmp=tmp_path)
    (tmp_path / "config.json").write_text("{}")
    line = _one_line_error(_cli("server", "--model", model, "--port", "0", cwd=tmp_path))
    assert repr(model) in line and ("no such directory" in line or "not a model directory" in line)


def test_generate_with_a_missing_model_directory_is_one_line(tmp_path):
    line = _one_line_error(_cli("generate", "--model", str(tmp_path / "nothing"), "--prompt", "hi"))
    assert "is no such directory" in line


def _provider(*extra: str, name: str | None = None):
    from palu_mlx.server import PaluModelProvider, server_parser

    args = server_parser().parse_args(["--model", MODEL, "--palu-bits", "2", *extra])
    return PaluModelProvider(args, model_name=name)


@needs_model
def test_the_servers_own_model_name_and_path_mean_the_loaded_model():
    provider = _provider(name="tiny-qwen3")
    provider.load_default()
    loaded, key = provider.model, provider.model_key
    for requested in ("tiny-qwen3", MODEL, os.path.abspath(MODEL), "default_model"):
        model, _ = provider.load(requested, None, "default_model")
        assert model is loaded and provider.model_key == key, requested


@needs_model
def test_a_reload_frees_the_old_model():
    import gc

    provider = _provider()
    model, _ = provider.load("default_model", None, "default_model")
    gc.collect()
    mx.clear_cache()
    one_model = mx.get_active_memory()
    # another key (the same directory spelled with a trailing slash) loads a second copy; the
    # caller still holds the old model while it loads, as mlx-lm's generation loop does
    model, _ = provider.load(MODEL + os.sep, None, "default_model")
    assert provider.model is model and provider.palu_config is not None
    held = mx.get_active_memory()
    assert held < 1.25 * one_model, (one_model, held)


@pytest.mark.slow
@needs_model
def test_a_request_naming_the_servers_model_is_served_without_a_reload(tmp_path):
    pytest.importorskip("kvbench")
    import http.client

    from palu_helpers import palu_server
    from palu_mlx.serving import resolve_model_arg

    name = "tiny-qwen3"
    if not os.path.samefile(resolve_model_arg(name), MODEL):
        pytest.skip("kvbench's tiny-qwen3 is not the embedded model")
    log = tmp_path / "server.log"
    with palu_server(name, log, "--max-tokens", "4", "--palu-bits", "2") as port:
        for model in (name, resolve_model_arg(name), "default_model"):
            body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request(
                "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            assert response.status == 200, (model, response.read()[:500])
            response.read()
    # one load at start-up, none for the requests
    assert log.read_text().count("requests are served") == 1, log.read_text()[-3000:]


def test_every_palu_cache_class_the_builder_saves_is_registered_by_constructing_one_cache():
    code = """
    from mlx_lm.models import cache as mlx_cache
    from palu_mlx import KVCacheConfig, PaluKVCache
    from palu_mlx.builder import _OURS

    assert not any(hasattr(mlx_cache, name) for name in _OURS)  # importing registers nothing
    PaluKVCache(KVCacheConfig(method="palu", head_dim=32))
    missing = [name for name, cls in _OURS.items() if getattr(mlx_cache, name, None) is not cls]
    print("missing", missing)
    """
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "missing []" in proc.stdout
