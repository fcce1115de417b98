"""A prompt cache on disk for ``palu-mlx server --prompt-cache-dir DIR``.

mlx-lm's server keeps each finished conversation's cache in memory (``LRUPromptCache``) and
reuses the longest matching one for the next request; everything is lost when the process ends.
:class:`StoredPromptCache` is that ``LRUPromptCache`` with a :class:`PromptStore` behind it:

* after a request finishes (mlx-lm inserts its cache, prompt and reply, once the answer is sent)
  the entry is written to DIR with :func:`palu_mlx.builder.save_prompt_cache`: the palu caches as
  they are held (compressed), a sha256 over every array and the metadata, written under a
  temporary name and renamed, so a reader never sees half a file. The write runs on the server's
  generation thread: other requests in flight wait for it. Entries of the same model and config
  whose tokens are a prefix of the new one are deleted (the new one serves them by trimming, as
  mlx-lm's in-memory cache drops such prefixes);
* a request whose tokens share a longer prefix with an entry on disk than with anything in memory
  loads that entry (longest common prefix wins; an entry running past the prefix is trimmed back
  to it, as mlx-lm trims a longer in-memory entry) instead of running the prefill again;
* entries are keyed by :func:`store_key`: the model's path and adapter, a fingerprint of its
  weights and arguments, and the palu cache config (with its calibration file's digest). An entry
  of another key is never loaded: it is skipped with a log line;
* DIR is capped at ``max_bytes``; the least recently used entries (file mtime, refreshed on every
  load) are deleted first. Files that are not entries (another program's, a corrupt or truncated
  entry) are skipped with a log line and never raise into the server.

The index is built from the files' safetensors headers (a few KB each) when the store opens, so
a restart costs a header read per entry, not a load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvspec import KVConfigError
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

__all__ = [
    "DEFAULT_MAX_BYTES",
    "PromptStore",
    "PromptStoreError",
    "StoredPromptCache",
    "add_store_arguments",
    "open_store",
    "serve",
    "store_key",
]

_log = logging.getLogger("palu_mlx.prompt_store")

#: default cap of DIR's entries (``--prompt-cache-dir-bytes``)
DEFAULT_MAX_BYTES = 2 * 1024**3
#: the entry format; part of every key, so entries of another layout are never loaded
STORE_FORMAT = "palu-mlx.prompt-store.v1"
_PREFIX = "palu-prompt-"
_SUFFIX = ".safetensors"
_TMP = re.compile(r"^\.palu-prompt-.*\.(\d+)\.tmp\.safetensors$")
# a safetensors header larger than this is not one this store wrote (its tokens are the bulk)
_MAX_HEADER = 64 * 1024 * 1024


class PromptStoreError(KVConfigError):
    """``--prompt-cache-dir`` / ``--prompt-cache-dir-bytes`` name something the store cannot use."""


# ---------------------------------------------------------------------------------- options
_BYTES = re.compile(r"^\s*(-?\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def _byte_count(value: str) -> int:
    match = _BYTES.match(value)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a byte count; give a positive integer, optionally with K, M, G or T (e.g. 2G)"
        )
    n = int(match.group(1)) * 1024 ** " KMGT".index((match.group(2) or " ").upper())
    if n <= 0:
        raise argparse.ArgumentTypeError(
            f"{value!r}: the cap must be a positive number of bytes (e.g. 2G); to keep nothing on disk, "
            "leave out --prompt-cache-dir"
        )
    return n


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """``--prompt-cache-dir`` and ``--prompt-cache-dir-bytes`` (one argument group)."""
    group = parser.add_argument_group("palu-mlx prompt cache on disk")
    group.add_argument(
        "--prompt-cache-dir",
        default=None,
        metavar="DIR",
        help="keep finished conversations' compressed prompt caches in DIR (created if missing) and "
        "reuse them after a restart",
    )
    group.add_argument(
        "--prompt-cache-dir-bytes",
        type=_byte_count,
        default=None,
        metavar="BYTES",
        help="cap on DIR's entries, least recently used deleted first "
        f"(default {DEFAULT_MAX_BYTES // 1024**3} GiB; K, M, G, T suffixes allowed)",
    )


def open_store(args: argparse.Namespace) -> PromptStore | None:
    """The store ``args`` ask for (None without ``--prompt-cache-dir``); ``PromptStoreError`` says why not."""
    directory = getattr(args, "prompt_cache_dir", None)
    cap = getattr(args, "prompt_cache_dir_bytes", None)
    if directory is None:
        if cap is not None:
            raise PromptStoreError(
                "--prompt-cache-dir-bytes needs --prompt-cache-dir DIR (the folder it caps)"
            )
        return None
    import mlx.core as mx

    if mx.distributed.init().size() > 1:
        # every rank would write its own shard's caches under one name
        raise PromptStoreError("--prompt-cache-dir is not supported on a distributed (multi-process) server")
    return PromptStore(directory, DEFAULT_MAX_BYTES if cap is None else cap)


# ---------------------------------------------------------------------------------- identity
def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weights_fingerprint(model: Any, samples: int = 64) -> str:
    """sha256 over the model's arguments and, per parameter, its name, dtype, shape and ``samples``
    elements spread over it.

    Hashing every weight would cost a pass over the whole model at each start (seconds for a 7B
    model); a strided sample of every array tells apart two models of one architecture (a
    fine-tune moves nearly every element) at the cost of a small gather per array.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    args = getattr(model, "args", None)
    described = vars(args) if args is not None and hasattr(args, "__dict__") else {}
    h.update(json.dumps(described, sort_keys=True, default=str).encode())
    flat = tree_flatten(model.parameters())
    picked = []
    for _, arr in flat:
        line = arr.reshape(-1)
        stride = max(1, line.size // samples)
        picked.append(line[::stride][:samples])
    mx.eval(picked)
    for (name, arr), sample in zip(flat, picked, strict=True):
        h.update(f"{name}\0{arr.dtype}\0{tuple(arr.shape)}\0".encode())
        if sample.size:
            h.update(bytes(memoryview(mx.contiguous(sample))))
    return h.hexdigest()


def store_key(model: Any, config: Any, model_path: str, adapter_path: str | None = None) -> tuple[str, dict]:
    """``(key, description)`` of the caches ``model`` with palu ``config`` makes.

    The description (path, adapter, weights fingerprint, config JSON, calibration digest) is
    written into every entry so a skipped entry's log line can say what it was made with; the key
    is a sha256 over it.
    """
    path = os.path.abspath(model_path) if os.path.isdir(model_path) else str(model_path)
    calibration = getattr(config, "palu_calibration", None)
    description = {
        "format": STORE_FORMAT,
        "model": path,
        "adapter": None if adapter_path is None else str(adapter_path),
        "weights": weights_fingerprint(model),
        "config": config.to_json(),
        "calibration": _file_digest(calibration) if calibration else None,
    }
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()
    return key, description


# ---------------------------------------------------------------------------------- the store
@dataclass
class Entry:
    """One entry file: its key, the tokens its cache holds, its size and last use (mtime)."""

    path: str
    key: str
    tokens: tuple[int, ...]
    nbytes: int
    used: float
    description: dict = field(default_factory=dict)


def _read_header(path: str) -> dict[str, str]:
    """The safetensors ``__metadata__`` of ``path`` without reading its arrays (ValueError if none)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if not 0 < n <= min(_MAX_HEADER, os.fstat(f.fileno()).st_size - 8):
            raise ValueError(f"header length {n} does not fit the file")
        text = f.read(n)
    header = json.loads(text)
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("no safetensors metadata")
    return meta


def _entry_metadata(meta: dict[str, str]) -> dict[str, Any]:
    """The store's fields of a palu prompt-cache file's metadata (ValueError when they are not there)."""
    from .builder import _FORMAT

    if meta.get("format") != _FORMAT:
        raise ValueError(f"not a palu-mlx prompt cache (format {meta.get('format')!r})")
    user = json.loads(meta.get("metadata", "{}"))
    if not isinstance(user, dict) or user.get("palu_store") != STORE_FORMAT:
        raise ValueError("a palu-mlx prompt cache, but not a prompt-store entry")
    tokens = json.loads(user["tokens"])
    if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise ValueError("its 'tokens' are not a list of token ids")
    description = json.loads(user["description"])
    if not isinstance(user.get("key"), str) or not isinstance(description, dict):
        raise ValueError("no key / description")
    return {"key": user["key"], "tokens": tuple(tokens), "description": description}


def _tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of two token tuples, by bisection over tuple-slice comparisons:
    each comparison runs in C, so an index of many long entries costs little per request."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PromptStore:
    """Entries of compressed prompt caches in one directory, capped at ``max_bytes``.

    Not thread-safe: the server calls it from its one generation thread.
    """

    def __init__(self, directory: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise PromptStoreError(
                f"--prompt-cache-dir-bytes {max_bytes!r}: the cap must be a positive number of bytes"
            )
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_bytes = max_bytes
        self._check_directory()
        self.entries: dict[str, Entry] = {}
        self.stats = {
            "hits": 0,
            "tokens_loaded": 0,
            "writes": 0,
            "bytes_written": 0,
            "evicted": 0,
            "skipped": 0,
        }
        self._logged: set[str] = set()
        self.scan()

    def _check_directory(self) -> None:
        d = self.directory
        if os.path.exists(d) and not os.path.isdir(d):
            raise PromptStoreError(
                f"--prompt-cache-dir {d!r} is a file; give a directory (created if missing)"
            )
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as exc:
            raise PromptStoreError(
                f"--prompt-cache-dir {d!r} cannot be created ({exc.strerror}); give a writable directory"
            ) from None
        # os.access answers for the real uid and says yes to root on a read-only mount: try a write
        try:
            with tempfile.NamedTemporaryFile(dir=d, prefix=".palu-probe-"):
                pass
        except OSError as exc:
            raise PromptStoreError(
                f"--prompt-cache-dir {d!r} is not writable ({exc.strerror}); give a directory this "
                "process can create files in"
            ) from None

    # ------------------------------------------------------------------ index
    def _skip(self, path: str, why: str, level: int = logging.WARNING) -> None:
        if path not in self._logged:  # once per file, not once per request
            self._logged.add(path)
            self.stats["skipped"] += 1
            _log.log(level, "prompt cache on disk: skipping %s: %s", path, why)

    def scan(self) -> None:
        """Rebuild the index from DIR's files; remove temporary files of writers that are gone."""
        self.entries = {}
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as exc:
            _log.warning("prompt cache on disk: %s cannot be listed: %s", self.directory, exc)
            return
        for name in names:
            path = os.path.join(self.directory, name)
            tmp = _TMP.match(name)
            if tmp:
                if not _pid_alive(int(tmp.group(1))):  # a writer that died mid-write
                    try:
                        os.remove(path)
                    except OSError:
                        pass
                continue
            if name.startswith(".palu-probe-"):
                continue
            if not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)):
                self._skip(path, "not a palu prompt-store entry (left as it is)", logging.INFO)
                continue
            try:
                st = os.stat(path)
                found = _entry_metadata(_read_header(path))
            except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
                self._skip(path, f"unreadable or corrupt entry ({exc})")
                continue
            self.entries[path] = Entry(
                path, found["key"], found["tokens"], st.st_size, st.st_mtime, found["description"]
            )

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def find(
        self, key: str, tokens: Sequence[int], longer_than: int = 0, trimmable: bool = True
    ) -> tuple[Entry | None, int]:
        """The entry of ``key`` sharing the longest prefix with ``tokens`` and how many tokens of it
        to reuse (at most ``len(tokens) - 1``: the last token always goes through the model, as in
        mlx-lm). Only prefixes longer than ``longer_than`` count. An entry longer than the shared
        prefix needs trimming: only when ``trimmable``. Entries of other keys are logged once."""
        best, best_n = None, longer_than
        tokens = tuple(tokens)
        limit = len(tokens) - 1
        for entry in self.entries.values():
            if entry.key != key:
                self._skip(entry.path, _mismatch(entry.description), logging.INFO)
                continue
            common = _common_prefix(entry.tokens, tokens)
            usable = min(common, limit)
            if usable < len(entry.tokens) and not trimmable:
                continue
            if usable > best_n or (usable == best_n and best is not None and entry.used > best.used):
                best, best_n = entry, usable
        return (best, best_n) if best is not None else (None, 0)

    def load(self, entry: Entry, key: str, expected: Sequence[str] | None = None) -> list[Any] | None:
        """The entry's caches, checked (checksum, key, tokens, layer classes and sizes); None, with a
        log line and the entry dropped from the index, when anything is off."""
        from .builder import load_prompt_cache, register_with_mlx_lm

        try:
            register_with_mlx_lm()
            cache, meta = load_prompt_cache(entry.path, return_metadata=True)
            found = _entry_metadata({"format": _builder_format(), "metadata": json.dumps(meta)})
            if found["key"] != key or found["tokens"] != entry.tokens:
                raise ValueError("its verified metadata does not match its header")
            names = [type(c).__name__ for c in cache]
            if expected is not None and names != list(expected):
                raise ValueError(f"its layers ({len(names)}) are not the model's ({len(expected)})")
            sizes = {c.size() for c in cache}
            if sizes != {len(entry.tokens)}:
                raise ValueError(f"its layers hold {sorted(sizes)} tokens, its metadata {len(entry.tokens)}")
        except Exception as exc:  # noqa: BLE001 - a bad file must cost a prefill, never the request
            self.entries.pop(entry.path, None)
            self._skip(
                entry.path,
                f"cannot be loaded ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
            )
            return None
        now = time.time()
        try:
            os.utime(entry.path, (now, now))  # the LRU order survives a restart
        except OSError:
            pass
        entry.used = now
        return cache

    def save(self, key: str, description: dict, tokens: Sequence[int], cache: Sequence[Any]) -> str | None:
        """Write ``cache`` (holding ``tokens``) as an entry of ``key``; returns its path, or None
        (logged) when it cannot be written or alone exceeds the cap. Then drops entries it
        subsumes and evicts the least recently used ones over the cap."""
        from .builder import save_prompt_cache

        tokens = tuple(int(t) for t in tokens)
        path = os.path.join(self.directory, f"{_PREFIX}{key[:16]}-{_tokens_digest(tokens)[:24]}{_SUFFIX}")
        now = time.time()
        if path in self.entries and self.entries[path].tokens == tokens:
            self.entries[path].used = now
            try:
                os.utime(path, (now, now))
            except OSError:
                pass
            return path
        meta = {
            "palu_store": STORE_FORMAT,
            "key": key,
            "description": json.dumps(description, sort_keys=True),
            "tokens": json.dumps(list(tokens)),
        }
        # written under a dot-name of this process (what a restart cleans up if it dies mid-write),
        # then renamed: readers see the whole file or none
        tmp = os.path.join(self.directory, f".{os.path.basename(path)}.{os.getpid()}.tmp{_SUFFIX}")
        try:
            save_prompt_cache(tmp, list(cache), meta)
            size = os.path.getsize(tmp)
            if size > self.max_bytes:
                os.remove(tmp)
                _log.info(
                    "prompt cache on disk: an entry of %d tokens (%d bytes) exceeds the cap of %d bytes; not kept",
                    len(tokens),
                    size,
                    self.max_bytes,
                )
                return None
            os.replace(tmp, path)
        except Exception as exc:  # noqa: BLE001 - a failed write must not end the generation thread
            if os.path.exists(tmp):
                try:
                    os.remove(tmp)
                except OSError:
                    pass
            _log.warning(
                "prompt cache on disk: cannot write %s: %s",
                path,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            return None
        self.entries[path] = Entry(path, key, tokens, size, now, description)
        self.stats["writes"] += 1
        self.stats["bytes_written"] += size
        if can_trim_prompt_cache(list(cache)):
            for other in list(self.entries.values()):
                if other.path != path and other.key == key and tokens[: len(other.tokens)] == other.tokens:
                    self._remove(other)
        self.evict()
        return path

    def _remove(self, entry: Entry) -> None:
        self.entries.pop(entry.path, None)
        try:
            os.remove(entry.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("prompt cache on disk: cannot delete %s: %s", entry.path, exc)

    def evict(self) -> None:
        """Delete least recently used entries until DIR's entries fit ``max_bytes``."""
        total = self.nbytes
        for entry in sorted(self.entries.values(), key=lambda e: e.used):
            if total <= self.max_bytes:
                break
            self._remove(entry)
            total -= entry.nbytes
            self.stats["evicted"] += 1


def _builder_format() -> str:
    from .builder import _FORMAT

    return _FORMAT


def _mismatch(description: dict) -> str:
    config = description.get("config")
    return (
        f"made for another model or cache config (model {description.get('model')!r}, "
        f"weights {str(description.get('weights'))[:12]}, config {config!s:.160})"
    )


# ---------------------------------------------------------------------------------- the server's cache
class StoredPromptCache(LRUPromptCache):
    """mlx-lm's ``LRUPromptCache`` backed by a :class:`PromptStore` for ``provider``'s model.

    ``provider`` is the server's model provider: its ``model``, ``model_key`` (mlx-lm's
    ``(path, adapter, draft)``) and ``palu_config`` say which entries fit.
    """

    def __init__(self, provider: Any, store: PromptStore, max_size: int = 10, max_bytes: int = 1 << 63):
        super().__init__(max_size, max_bytes)
        self.provider = provider
        self.store = store
        self._identity: tuple[Any, Any, str | None, dict, list[str]] | None = None
        # prompts of requests being served (fetched, not yet finished): mlx-lm also inserts caches
        # of their prompt segments during the prefill, which are not written (see insert_cache)
        self._serving: deque[tuple[int, ...]] = deque(maxlen=256)

    def _key(self, model_key: Any) -> tuple[str, dict, list[str]] | None:
        """The store key of the loaded model (computed once per load), or None when there is none
        to use: another model than the loaded one, no palu config, a draft model's caches mixed in."""
        provider = self.provider
        model = getattr(provider, "model", None)
        if model is None or model_key != getattr(provider, "model_key", None):
            return None
        cached = self._identity
        if cached is not None and cached[0] == model_key and cached[1]() is model:
            return None if cached[2] is None else (cached[2], cached[3], cached[4])
        key, description, expected = None, {}, []
        config = getattr(provider, "palu_config", None)
        if getattr(provider, "draft_model", None) is not None:
            _log.info("prompt cache on disk: not used while a draft model is loaded")
        elif config is None:
            _log.info("prompt cache on disk: not used: the model has no palu cache config")
        else:
            from mlx_lm.models.cache import make_prompt_cache

            key, description = store_key(model, config, model_key[0], model_key[1])
            expected = [type(c).__name__ for c in make_prompt_cache(model)]
            usable = sum(e.key == key for e in self.store.entries.values())
            _log.info(
                "prompt cache on disk: %s, %d entries (%d bytes, cap %d) of which %d fit this model and config",
                self.store.directory,
                len(self.store.entries),
                self.store.nbytes,
                self.store.max_bytes,
                usable,
            )
        self._identity = (model_key, weakref.ref(model), key, description, expected)
        return None if key is None else (key, description, expected)

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        self._serving.append(tuple(tokens))
        cache, rest = super().fetch_nearest_cache(model, tokens)
        in_memory = len(tokens) - len(rest) if cache is not None else 0
        found = self._key(model)
        if found is None:
            return cache, rest
        key, _, expected = found
        while True:
            entry, n = self.store.find(key, tokens, longer_than=in_memory)
            if entry is None:
                return cache, rest
            # a file that fails its checks is dropped from the index: the next best is tried
            loaded = self.store.load(entry, key, expected)
            if loaded is None:
                continue
            extra = len(entry.tokens) - n
            if not extra or (can_trim_prompt_cache(loaded) and trim_prompt_cache(loaded, extra) == extra):
                break
            self.store.entries.pop(entry.path, None)  # cannot serve this prefix; not tried again
        self.store.stats["hits"] += 1
        self.store.stats["tokens_loaded"] += n
        _log.info(
            "prompt cache on disk: %d of %d prompt tokens loaded from %s (their prefill skipped)",
            n,
            len(tokens),
            os.path.basename(entry.path),
        )
        return loaded, tokens[n:]

    def insert_cache(
        self, model: Any, tokens: list[int], prompt_cache: list[Any], *, cache_type: str = "assistant"
    ):
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        # Only a finished request's cache is written: its tokens run past the prompt it was
        # fetched for (the reply). mlx-lm's batch path also inserts caches at the ends of prompt
        # segments (system prompt, user turn, the prompt itself) while the prefill runs; writing
        # those would delay the request's first token, and the finished cache serves them (trimmed).
        finished = None
        for i, prompt in enumerate(self._serving):
            if len(tokens) > len(prompt) and tuple(tokens[: len(prompt)]) == prompt:
                finished = i
                break
        if finished is None:
            return
        del self._serving[finished]
        found = self._key(model)
        if found is None:
            return
        key, description, _ = found
        held = {c.size() for c in prompt_cache}
        if len(held) != 1:
            return
        (n,) = held
        if not 0 < n <= len(tokens):
            return
        path = self.store.save(key, description, tokens[:n], prompt_cache)
        if path is not None:
            _log.info(
                "prompt cache on disk: %d tokens (of %d) written to %s (%d bytes)",
                n,
                len(tokens),
                os.path.basename(path),
                self.store.entries[path].nbytes,
            )


def serve(host: str, port: int, provider: Any, store: PromptStore) -> None:
    """``mlx_lm.server.run`` with :class:`StoredPromptCache` in place of its ``LRUPromptCache``."""
    from mlx_lm.server import ResponseGenerator, _run_http_server

    prompt_cache = StoredPromptCache(provider, store, provider.cli_args.prompt_cache_size)
    _run_http_server(host, port, ResponseGenerator(provider, prompt_cache))
