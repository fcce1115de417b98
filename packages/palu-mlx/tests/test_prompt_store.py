"""The prompt cache on disk (``palu-mlx server --prompt-cache-dir``): the store on a tiny random
model (token ids below its vocabulary of 256), then the server restarted on one directory."""

from __future__ import annotations

import logging
import os
import shutil
import time
import types
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from palu_helpers import make_tiny_qwen3, palu_server
from palu_mlx import KVCacheBuilder
from palu_mlx.config import KVCacheConfig
from palu_mlx.prompt_store import (
    PromptStore,
    PromptStoreError,
    StoredPromptCache,
    open_store,
    store_key,
)

VOCAB = 256
HEAD_DIM = 32


def _tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in mx.random.randint(0, VOCAB, (n,), key=mx.random.key(seed)).tolist()]


def _installed(bits: float = 2, seed: int = 0):
    model = make_tiny_qwen3(seed=seed)
    config = KVCacheConfig(palu_bits=bits).for_head_dim(HEAD_DIM)
    KVCacheBuilder.install(model, config)
    return model, config


@pytest.fixture(scope="module")
def tiny():
    model, config = _installed()
    return types.SimpleNamespace(
        model=model, model_key=("tiny", None, None), palu_config=config, draft_model=None
    )


def _prefilled(model, tokens):
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _key(provider):
    return store_key(provider.model, provider.palu_config, *provider.model_key[:2])


def _save(store, provider, tokens):
    key, description = _key(provider)
    return store.save(key, description, tokens, _prefilled(provider.model, tokens))


def _logits_after(model, cache, tokens):
    return model(mx.array([tokens]), cache=cache)


def test_entries_are_found_by_longest_prefix_trimmed_and_continue_bit_identically(tmp_path, tiny):
    store = PromptStore(tmp_path, 1 << 30)
    key, _ = _key(tiny)
    p, q, r = _tokens(1, 70), _tokens(2, 20), _tokens(3, 30)
    x, y = p + q, p[:10] + r
    _save(store, tiny, x)
    _save(store, tiny, y)
    assert len(store.entries) == 2

    # a restarted store finds them from the files' headers
    store = PromptStore(tmp_path, 1 << 30)
    query = p + q[:5] + _tokens(4, 6)
    entry, n = store.find(key, query)
    assert entry.tokens == tuple(x) and n == 75  # the longest common prefix, trimmed back to it
    entry, n = store.find(key, y + [7, 8])
    assert entry.tokens == tuple(y) and n == len(y)
    entry, n = store.find(key, x)  # the whole entry: its last token still goes through the model
    assert entry.tokens == tuple(x) and n == len(x) - 1
    assert store.find(key, _tokens(9, 40))[1] < 5  # unrelated tokens: nothing worth loading

    # through the server's prompt cache: the loaded, trimmed cache continues as the one in memory
    cache, rest = StoredPromptCache(tiny, store).fetch_nearest_cache(tiny.model_key, query)
    assert rest == query[75:] and {c.size() for c in cache} == {75}
    expected = _prefilled(tiny.model, x)
    for c in expected:
        c.trim(len(x) - 75)
    assert mx.array_equal(
        _logits_after(tiny.model, cache, rest), _logits_after(tiny.model, expected, rest)
    ).item()
    assert store.stats["hits"] == 1 and store.stats["tokens_loaded"] == 75

    # a longer conversation replaces the entries it extends
    _save(store, tiny, x + _tokens(5, 8))
    assert sorted(len(e.tokens) for e in store.entries.values()) == [len(y), len(x) + 8]
    assert len(os.listdir(tmp_path)) == 2


def test_finished_requests_are_written_and_memory_wins_when_it_holds_as_much(tmp_path, tiny):
    store = PromptStore(tmp_path, 1 << 30)
    prompt, reply = _tokens(11, 70), _tokens(12, 4)
    lru = StoredPromptCache(tiny, store)
    assert lru.fetch_nearest_cache(tiny.model_key, prompt) == (None, prompt)
    # during the prefill mlx-lm keeps caches of the prompt's segments: memory only
    lru.insert_cache(tiny.model_key, prompt[:30], _prefilled(tiny.model, prompt[:30]), cache_type="user")
    lru.insert_cache(tiny.model_key, prompt[:-1], _prefilled(tiny.model, prompt[:-1]))
    assert not store.entries
    # the finished request (prompt and reply) is written
    lru.insert_cache(tiny.model_key, prompt + reply, _prefilled(tiny.model, prompt + reply))
    assert [e.tokens for e in store.entries.values()] == [tuple(prompt + reply)]
    lru.fetch_nearest_cache(tiny.model_key, prompt + reply + [1, 2])
    assert store.stats["hits"] == 0  # served from memory, nothing read from disk


def test_the_cap_evicts_the_least_recently_used_entries(tmp_path, tiny):
    key, _ = _key(tiny)
    probe = PromptStore(tmp_path / "probe", 1 << 30)
    one = probe.entries[_save(probe, tiny, _tokens(20, 70))].nbytes
    store = PromptStore(tmp_path / "capped", int(2.5 * one))
    a, b, c = _tokens(21, 70), _tokens(22, 70), _tokens(23, 70)
    _save(store, tiny, a)
    _save(store, tiny, b)
    entry, _ = store.find(key, a + [1])
    assert store.load(entry, key) is not None  # a is now more recently used than b
    _save(store, tiny, c)
    kept = {e.tokens for e in store.entries.values()}
    assert kept == {tuple(a), tuple(c)} and store.stats["evicted"] == 1
    assert store.nbytes <= store.max_bytes
    assert len(os.listdir(tmp_path / "capped")) == 2
    # the order survives a restart (file mtimes): the next eviction takes a, then c
    store = PromptStore(tmp_path / "capped", int(2.5 * one))
    _save(store, tiny, _tokens(24, 70))
    assert {e.tokens for e in store.entries.values()} == {tuple(c), tuple(_tokens(24, 70))}
    # an entry alone over the cap is not kept
    small = PromptStore(tmp_path / "small", one // 2)
    assert _save(small, tiny, a) is None and not small.entries


def test_corrupt_truncated_and_foreign_files_are_skipped_with_a_log_line(tmp_path, tiny, caplog):
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    key, _ = _key(tiny)
    good = _tokens(30, 70)
    store = PromptStore(tmp_path, 1 << 30)
    path = _save(store, tiny, good)
    shutil.copy(path, tmp_path / "kept")
    longer = good + _tokens(31, 10)
    flipped = _save(store, tiny, longer)  # deletes `good`'s file (a prefix): put it back
    shutil.move(tmp_path / "kept", path)
    blob = bytearray(Path(flipped).read_bytes())
    blob[-100] ^= 0xFF  # a byte of the arrays: the header still reads, the checksum does not match
    Path(flipped).write_bytes(bytes(blob))
    truncated = tmp_path / "palu-prompt-0000000000000000-truncated.safetensors"
    truncated.write_bytes(Path(path).read_bytes()[:200])
    (tmp_path / "palu-prompt-garbage.safetensors").write_bytes(b"\x00" * 3)
    (tmp_path / "notes.txt").write_text("not a cache")
    plain = KVCache()
    plain.update_and_fetch(mx.zeros((1, 4, 3, 32)), mx.zeros((1, 4, 3, 32)))
    save_prompt_cache(str(tmp_path / "palu-prompt-mlx-lm.safetensors"), [plain], {"model": "m"})

    with caplog.at_level(logging.INFO, logger="palu_mlx.prompt_store"):
        store = PromptStore(tmp_path, 1 << 30)
        assert set(store.entries) == {path, flipped}
        lru = StoredPromptCache(tiny, store)
        query = longer + [3, 4]
        cache, rest = lru.fetch_nearest_cache(tiny.model_key, query)
    log = caplog.text
    assert "truncated.safetensors" in log and "garbage.safetensors" in log and "notes.txt" in log
    assert "mlx-lm.safetensors" in log
    assert "checksum mismatch" in log  # the flipped file was tried, refused and dropped
    # the next best entry served the request instead of a wrong cache
    assert flipped not in store.entries and len(rest) == len(query) - len(good)
    expected = _prefilled(tiny.model, good)
    assert mx.array_equal(
        _logits_after(tiny.model, cache, rest), _logits_after(tiny.model, expected, rest)
    ).item()


def test_entries_of_another_model_or_config_are_never_used(tmp_path, tiny, caplog):
    tokens = _tokens(40, 70)
    _save(PromptStore(tmp_path, 1 << 30), tiny, tokens)
    for bits, seed, path in ((4, 0, "tiny"), (2, 1, "tiny"), (2, 0, "elsewhere")):
        model, config = _installed(bits, seed)
        other = types.SimpleNamespace(
            model=model, model_key=(path, None, None), palu_config=config, draft_model=None
        )
        assert _key(other)[0] != _key(tiny)[0]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="palu_mlx.prompt_store"):
            store = PromptStore(tmp_path, 1 << 30)
            cache, rest = StoredPromptCache(other, store).fetch_nearest_cache(other.model_key, tokens + [1])
        assert cache is None and rest == tokens + [1]
        assert "made for another model or cache config" in caplog.text
    # the same model and config again: used
    cache, rest = StoredPromptCache(tiny, PromptStore(tmp_path, 1 << 30)).fetch_nearest_cache(
        tiny.model_key, tokens + [1]
    )
    assert cache is not None and rest == [1]


def test_a_failed_write_leaves_no_partial_file(tmp_path, tiny, monkeypatch, caplog):
    store = PromptStore(tmp_path, 1 << 30)
    before = _save(store, tiny, _tokens(50, 70))
    real = mx.save_safetensors

    def half_then_fail(file, arrays, metadata=None):
        real(file, arrays, metadata)
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", half_then_fail)
    with caplog.at_level(logging.WARNING, logger="palu_mlx.prompt_store"):
        assert _save(store, tiny, _tokens(51, 70)) is None
    assert "No space left on device" in caplog.text
    assert os.listdir(tmp_path) == [os.path.basename(before)]
    assert set(store.entries) == {before}
    # a temporary file a dead writer left behind is removed when a store opens the directory
    monkeypatch.undo()
    stale = tmp_path / f".{os.path.basename(before)}.999999999.tmp.safetensors"
    stale.write_bytes(b"partial")
    PromptStore(tmp_path, 1 << 30)
    assert not stale.exists()


def test_bad_options_are_refused_naming_what_is_allowed(tmp_path, capsys):
    from palu_mlx.server import server_main, server_parser

    parser = server_parser()
    for bad in ("-5", "0", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--prompt-cache-dir", str(tmp_path), "--prompt-cache-dir-bytes", bad])
        assert "positive" in capsys.readouterr().err
    args = parser.parse_args(["--prompt-cache-dir", str(tmp_path), "--prompt-cache-dir-bytes", "3G"])
    assert open_store(args).max_bytes == 3 * 1024**3
    assert (
        open_store(parser.parse_args(["--prompt-cache-dir", str(tmp_path / "new")])).max_bytes == 2 * 1024**3
    )
    assert (tmp_path / "new").is_dir()
    with pytest.raises(PromptStoreError, match="needs --prompt-cache-dir"):
        open_store(parser.parse_args(["--prompt-cache-dir-bytes", "1G"]))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(PromptStoreError, match="is a file; give a directory"):
        PromptStore(a_file)
    if os.path.isdir("/proc/self"):  # not writable, even by root
        with pytest.raises(PromptStoreError, match="not writable|cannot be created"):
            PromptStore("/proc/self")
    with pytest.raises(PromptStoreError, match="positive"):
        PromptStore(tmp_path, -1)
    # the command reports it before loading anything
    assert server_main(["--prompt-cache-dir", str(a_file)]) == 1
    assert "is a file; give a directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- the server
MODEL = os.environ.get("KVBENCH_EMBEDDED_MODEL") or str(
    Path(__file__).resolve().parents[3] / "benchmarks" / "model" / "tiny-qwen3"
)
_TEXT = (
    "The json module reads and writes JSON text. Its load and loads functions turn a file or a string "
    "into dictionaries, lists, strings, numbers, booleans and None; dump and dumps do the reverse, "
    "with options for indentation, sorted keys and custom encoders for objects it does not know."
)


def _serve(tmp_path, name, store_dir=None):
    """The server (:func:`palu_server`, entered with ``with``) and its log."""
    options = ["--palu-bits", "2"]
    if store_dir is not None:
        options += ["--prompt-cache-dir", str(store_dir)]
    log = tmp_path / f"{name}.log"
    return palu_server(MODEL, log, *options, name=f"palu-mlx server ({name})"), log


def _ask(port, messages):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
    )
    reply = client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=8, temperature=0.0
    )
    details = reply.usage.prompt_tokens_details
    return (
        reply.choices[0].message.content,
        (details.cached_tokens if details else 0) or 0,
        reply.usage.total_tokens,
    )


def _wait_for(log, text, timeout_s=60.0):
    """The server writes an entry after it has answered: wait for its log line before stopping it."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in the server's log:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_restarted_server_continues_from_disk_as_an_uninterrupted_one(tmp_path):
    pytest.importorskip("openai")
    if not os.path.isdir(MODEL):
        pytest.skip(f"the embedded model is not at {MODEL}")
    first = [{"role": "user", "content": _TEXT + " What does dumps return?"}]

    def follow_up(reply):
        return [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And loads?"}]

    # the reference: one server without a directory, both turns in one process
    context, _ = _serve(tmp_path, "memory")
    with context as port:
        reply_1, _, _ = _ask(port, first)
        reference, cached_in_memory, _ = _ask(port, follow_up(reply_1))
    assert cached_in_memory > 0

    store_dir = tmp_path / "store"
    context, log = _serve(tmp_path, "writer", store_dir)
    with context as port:
        reply, _, total = _ask(port, first)
        assert reply == reply_1
        _wait_for(log, f"tokens (of {total}) written to palu-prompt-")
    entries = [n for n in os.listdir(store_dir) if n.startswith("palu-prompt-")]
    assert len(entries) == 1

    context, log = _serve(tmp_path, "restarted", store_dir)
    with context as port:
        answer, cached, _ = _ask(port, follow_up(reply_1))
    assert answer == reference
    assert cached == cached_in_memory  # the prefix the first server kept in memory, read from disk
    text = log.read_text()
    assert f"prompt cache on disk: {cached} of " in text and "loaded from palu-prompt-" in text
