"""The embedded model's corpus: English documentation text that ships with Python itself.

Nothing is downloaded. The text is the Python standard library's own documentation, available
offline on every machine that has CPython:

* ``pydoc_data.topics.topics``: the language reference topics that ``help()`` prints
  (about 80 topics, ~0.45 MB of English prose with code snippets);
* the docstrings (``inspect.getdoc``) of a fixed, recorded list of standard-library modules and
  of the public classes, functions and methods they define.

Each topic or module is one *document*. The held-out split is whole documents chosen by a fixed
rule (every ``HELDOUT_EVERY``-th document in sorted order), so no held-out sentence is ever seen in
training. Docstrings can change between Python patch releases, so the held-out text is ALSO
committed as ``kvbench/data/heldout.txt`` (kvbench's default evaluation text):
``load_corpus("heldout")`` reads that file, which
makes held-out perplexity comparable on every machine. ``load_corpus("train")`` rebuilds the
training text from the running interpreter; ``corpus_record()`` describes exactly what was used
(Python version, document names, sizes and sha256).

Usage::

    from corpus import load_corpus
    text = load_corpus("heldout")          # str, the committed held-out text
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import platform
import warnings
from pathlib import Path

from kvbench.models import default_text_path

__all__ = [
    "HELDOUT_PATH",
    "LONG_PACKAGES",
    "MODULES",
    "corpus_record",
    "long_streams",
    "iter_documents",
    "load_corpus",
    "split_documents",
]

# the held-out text ships with kvbench (its compare default); this module only reads and regenerates it
HELDOUT_PATH = default_text_path()

#: every HELDOUT_EVERY-th document (sorted by name) goes to the held-out split
HELDOUT_EVERY = 10

#: documents are joined with this separator (it also separates training sequences)
DOC_SEPARATOR = "\n\n"

# Pure-library modules with substantial English docstrings; no GUI, no side effects on import,
# nothing platform-specific. The list is part of the corpus record: change it and the hash changes.
MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "bz2", "calendar", "cmd", "codecs",
    "collections", "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "dis", "doctest", "email", "enum", "filecmp", "fileinput",
    "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "graphlib", "gzip",
    "hashlib", "heapq", "hmac", "html", "html.parser", "http", "http.client", "http.cookies",
    "http.server", "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "keyword",
    "linecache", "locale", "logging", "logging.handlers", "lzma", "mailbox", "math",
    "mimetypes", "netrc", "numbers", "operator", "optparse", "os", "os.path", "pathlib",
    "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint", "profile",
    "pstats", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "socketserver", "sqlite3",
    "statistics", "string", "struct", "subprocess", "sys", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "token", "tokenize", "trace", "traceback", "types", "typing",
    "unittest", "unittest.mock", "urllib.parse", "urllib.request", "uuid", "warnings", "wave",
    "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zlib", "zoneinfo",
    "array", "asyncio.base_events", "asyncio.events", "asyncio.futures", "asyncio.locks",
    "asyncio.queues", "asyncio.streams", "asyncio.tasks", "binascii", "builtins", "cmath", "code",
    "codeop", "collections.abc", "compileall", "concurrent.futures", "contextvars", "ctypes",
    "email.headerregistry", "email.message", "email.parser", "email.utils", "gc", "getpass",
    "importlib", "importlib.abc", "importlib.metadata", "importlib.resources",
    "json.decoder", "json.encoder", "logging.config", "marshal", "multiprocessing.pool",
    "multiprocessing.process", "multiprocessing.queues", "opcode", "pdb", "posix", "pyclbr", "pydoc",
    "runpy", "stat", "symtable", "sysconfig", "tabnanny", "time", "tracemalloc", "unicodedata",
    "unittest.case", "unittest.loader", "unittest.suite", "urllib.error", "urllib.robotparser",
    "venv", "wsgiref.handlers", "wsgiref.simple_server", "wsgiref.util", "xml.sax",
    "xml.sax.handler", "xmlrpc.client", "xmlrpc.server", "zipimport",
)  # fmt: skip


def _clean(text: str) -> str:
    """Normalise whitespace so the text does not depend on the source's indentation style."""
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return "\n".join(lines)


def _module_document(name: str) -> str:
    """The module docstring followed by those of the public classes/functions/methods it defines."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(name)
    parts: list[str] = []
    seen: set[str] = set()

    def add(header: str, obj: object) -> None:
        doc = inspect.getdoc(obj)
        # Inherited or repeated docstrings (e.g. object.__init__'s) would add the same text twice.
        if doc and len(doc) >= 40 and doc not in seen:
            seen.add(doc)
            parts.append(f"{header}\n{_clean(doc)}")

    add(f"Module {name}", module)
    for attr in sorted(vars(module)):
        if attr.startswith("_"):
            continue
        obj = vars(module)[attr]
        if getattr(obj, "__module__", None) != module.__name__:
            continue  # re-exported from elsewhere: belongs to its own module's document
        if inspect.isclass(obj):
            add(f"class {name}.{attr}", obj)
            for meth_name in sorted(vars(obj)):
                if meth_name.startswith("_") and meth_name != "__init__":
                    continue
                meth = vars(obj)[meth_name]
                if inspect.isroutine(meth):
                    add(f"{name}.{attr}.{meth_name}", meth)
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            add(f"{name}.{attr}", obj)
    return "\n\n".join(parts)


def iter_documents() -> list[tuple[str, str]]:
    """All ``(name, text)`` documents, sorted by name: ``topic:<key>`` and ``module:<name>``."""
    from pydoc_data.topics import topics

    docs = [(f"topic:{key}", _clean(text)) for key, text in topics.items()]
    docs += [(f"module:{name}", _module_document(name)) for name in MODULES]
    docs = [(name, text) for name, text in docs if text]
    return sorted(docs)


def split_documents(
    docs: list[tuple[str, str]] | None = None,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(train, heldout)``: every ``HELDOUT_EVERY``-th document by sorted name is held out."""
    docs = iter_documents() if docs is None else docs
    train = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_EVERY // 2]
    heldout = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_EVERY // 2]
    return train, heldout


def _join(docs: list[tuple[str, str]]) -> str:
    return DOC_SEPARATOR.join(text for _, text in docs)


def load_corpus(split: str = "train") -> str:
    """The corpus text of one split.

    ``"heldout"`` reads the committed ``kvbench/data/heldout.txt`` (identical on every
    machine); ``"train"`` rebuilds the training text from this interpreter's standard library.
    """
    if split == "heldout":
        return HELDOUT_PATH.read_text(encoding="utf-8")
    if split == "train":
        return _join(split_documents()[0])
    raise ValueError(f"split must be 'train' or 'heldout'; got {split!r}")


def write_heldout() -> Path:
    """Regenerate ``kvbench/data/heldout.txt`` from this interpreter (done once, then committed)."""
    HELDOUT_PATH.parent.mkdir(parents=True, exist_ok=True)
    HELDOUT_PATH.write_text(_join(split_documents()[1]) + "\n", encoding="utf-8")
    return HELDOUT_PATH


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def corpus_record() -> dict:
    """Exactly what the corpus is: source, Python version, documents of each split, sizes, hashes."""
    train, heldout = split_documents()
    train_text = _join(train)
    heldout_file = HELDOUT_PATH.read_text(encoding="utf-8") if HELDOUT_PATH.exists() else None
    return {
        "source": "Python standard library documentation: pydoc_data.topics.topics + inspect.getdoc "
        "of the listed modules and their public classes, functions and methods",
        "python_version": platform.python_version(),
        "modules": list(MODULES),
        "heldout_rule": f"every {HELDOUT_EVERY}th document in sorted name order "
        f"(index % {HELDOUT_EVERY} == {HELDOUT_EVERY // 2})",
        "train_documents": [name for name, _ in train],
        "heldout_documents": [name for name, _ in heldout],
        "train_chars": len(train_text),
        "train_sha256": _sha256(train_text),
        "heldout_file": "packages/kvbench/src/kvbench/data/heldout.txt",
        "heldout_chars": len(heldout_file) if heldout_file is not None else None,
        "heldout_sha256": _sha256(heldout_file) if heldout_file is not None else None,
    }


# --------------------------------------------------------------------------- long-context corpus
# The long-context model needs far more text than the 1.4 MB of stdlib documentation, and long
# documents. Both are on every machine that has the bench environment: the standard library's own
# source files (long, self-referential: a model learns to look back to copy identifiers) and the
# docstrings of the installed scientific and ML packages (English prose with code examples).

#: third-party packages whose docstrings join the long corpus (all installed by the bench env)
LONG_PACKAGES: tuple[str, ...] = (
    "numpy", "sympy", "networkx", "mpmath", "matplotlib", "transformers", "torch",
    "pydantic", "jinja2", "pygments", "click", "rich", "tokenizers",
)  # fmt: skip

#: stdlib folders that are tests, GUIs, demos or vendored data rather than library text
_STDLIB_SKIP = {
    "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
    "__pycache__", "pydoc_data", "encodings", "unittest/test", "distutils",
}  # fmt: skip

#: relative weight of each stream when sampling training windows
# stdlib-docs is small (0.35 M tokens) and the held-out domain: a low weight keeps it from being memorised.
LONG_WEIGHTS = {"stdlib-docs": 0.10, "package-docstrings": 0.50, "stdlib-source": 0.40}

#: cap per stream (characters), so a package update cannot blow up tokenization time
_STREAM_CAP = 60_000_000


def _heldout_files() -> set[Path]:
    """Source files of every held-out module (a package's whole folder): never trained on."""
    import importlib.util

    out: set[Path] = set()
    for name, _ in split_documents()[1]:
        kind, _, mod = name.partition(":")
        if kind != "module":
            continue
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue  # built-in (sys, marshal): no source file
        origin = Path(spec.origin)
        out.update(origin.parent.rglob("*.py") if origin.name == "__init__.py" else [origin])
    return {p.resolve() for p in out}


def _python_files(root: Path, skip: set[str]) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in skip for part in rel.split("/")[:-1]) or any(rel.startswith(s + "/") for s in skip):
            continue
        files.append(path)
    return files


def _docstring_document(source: str, header: str) -> str:
    """Module, class and function docstrings of one source file, each under a one-line header."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    doc = ast.get_docstring(tree)
    if doc and len(doc) >= 40:
        parts.append(f"Module {header}\n{_clean(doc)}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                parts.append(f"{kind} {header}.{node.name}\n{_clean(doc)}")
    return "\n\n".join(parts)


def _licence(dist: str) -> str:
    from importlib import metadata

    try:
        meta = metadata.metadata(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
    expr = meta.get("License-Expression") or ""
    if expr:
        return expr
    classifiers = [
        c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")
    ]
    lic = (meta.get("License") or "").splitlines()[0:1]
    return "; ".join(classifiers) or (lic[0][:80] if lic else "unknown")


def long_streams() -> list[dict]:
    """The long-context training corpus as named streams of documents, with sources and licences.

    Each entry: ``{"name", "weight", "documents": [(name, text)], "sources": {...}}``. Nothing here
    is held out by ``split_documents``: held-out modules' source files are excluded outright.
    """
    import sysconfig
    from importlib import metadata

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    heldout = _heldout_files()
    std_files = [p for p in _python_files(stdlib, _STDLIB_SKIP) if p.resolve() not in heldout]

    source_docs, total = [], 0
    for path in std_files:
        text = _clean(path.read_text(encoding="utf-8", errors="replace"))
        if len(text) < 200 or total > _STREAM_CAP:
            continue
        source_docs.append((f"source:{path.relative_to(stdlib).as_posix()}", text))
        total += len(text)

    doc_docs, sources, total = [], {}, 0
    for path in std_files:
        name = path.relative_to(stdlib).with_suffix("").as_posix().replace("/", ".")
        text = _docstring_document(path.read_text(encoding="utf-8", errors="replace"), name)
        if text:
            doc_docs.append((f"docstrings:{name}", text))
            total += len(text)
    sources["stdlib"] = {"version": platform.python_version(), "licence": "PSF-2.0"}
    for package in LONG_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        dist = {"jinja2": "Jinja2", "pygments": "Pygments"}.get(package, package)
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = None
        sources[package] = {"version": version, "licence": _licence(dist)}
        for path in _python_files(root, {"tests", "test", "testing"}):
            if total > _STREAM_CAP:
                break
            rel = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
            text = _docstring_document(path.read_text(encoding="utf-8", errors="replace"), f"{package}.{rel}")
            if len(text) >= 200:
                doc_docs.append((f"docstrings:{package}.{rel}", text))
                total += len(text)
    return [
        {
            "name": "stdlib-docs",
            "weight": LONG_WEIGHTS["stdlib-docs"],
            "documents": split_documents()[0],
            "sources": {"stdlib": sources["stdlib"]},
        },
        {
            "name": "package-docstrings",
            "weight": LONG_WEIGHTS["package-docstrings"],
            "documents": doc_docs,
            "sources": sources,
        },
        {
            "name": "stdlib-source",
            "weight": LONG_WEIGHTS["stdlib-source"],
            "documents": source_docs,
            "sources": {"stdlib": sources["stdlib"]},
        },
    ]


def long_corpus_record(streams: list[dict]) -> dict:
    """What the long corpus was: per stream its weight, sources with licences, size and sha256."""
    out = {"heldout_exclusion": "source files of held-out modules are excluded; held-out text unchanged"}
    for stream in streams:
        text = _join(stream["documents"])
        out[stream["name"]] = {
            "weight": stream["weight"],
            "documents": len(stream["documents"]),
            "chars": len(text),
            "sha256": _sha256(text),
            "sources": stream["sources"],
        }
    return out


if __name__ == "__main__":
    import json

    write_heldout()
    record = corpus_record()
    short = {k: v for k, v in record.items() if not k.endswith("_documents")}
    short["n_train_documents"] = len(record["train_documents"])
    short["n_heldout_documents"] = len(record["heldout_documents"])
    print(json.dumps(short, indent=2))
