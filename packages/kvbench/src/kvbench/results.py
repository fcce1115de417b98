"""Results files: the compare document's layout, its stamp (machine, versions, date), strict
JSON, and digests of the weights and text a result was measured on.

Mistakes are reported with :class:`~kvbench.errors.CompareError` (importable from here too).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from .checks import check_result, check_rows
from .errors import CompareError
from .protocol import MEASURES

__all__ = [
    "SCHEMA",
    "CompareError",
    "build_result",
    "environment_stamp",
    "to_jsonable",
    "write_json",
    "read_json",
    "RESULTS_ENV_VAR",
    "results_path",
    "weights_digest",
    "text_digest",
    "run_of",
]


#: the layout :func:`build_result` writes
SCHEMA = "kvbench.compare/2"


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
    """Write ``data`` as indented, strict JSON (parent folders created); returns the path.

    The text is built first and written to a temporary file beside ``path``, then renamed over it:
    data that cannot be written (CompareError naming the path) or a failed write never leaves a
    half-written result, and an existing file at ``path`` stays as it was.
    """
    out = Path(path)
    try:
        text = json.dumps(to_jsonable(data), indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as err:
        raise CompareError(f"result for {str(out)!r} cannot be written as JSON: {err}") from None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=out.parent, prefix=f".{out.name}.", suffix=".tmp", delete=False
        ) as handle:
            handle.write(text)
        os.replace(handle.name, out)
    except OSError as err:
        if "handle" in locals():
            Path(handle.name).unlink(missing_ok=True)
        raise CompareError(f"result file {str(out)!r} cannot be written: {err}") from None
    return out


#: the environment variable naming the folder benchmarks write their results into
RESULTS_ENV_VAR = "KVBENCH_RESULTS"


def results_path(name: str) -> Path:
    """``<results folder>/name``: where a benchmark writes its result ``name`` by default.

    The folder is named by the environment variable ``KVBENCH_RESULTS`` (the repository's
    hatch.toml sets it to ``benchmarks/results``); kvbench does not know any checkout's layout.
    Raises ``CompareError`` saying so when it is unset (pass the script an explicit output path,
    or set the variable).
    """
    folder = os.environ.get(RESULTS_ENV_VAR)
    if not folder:
        raise CompareError(
            f"no results folder: the environment variable {RESULTS_ENV_VAR} is not set (the hatch "
            f"environments set it to benchmarks/results); set it or give the output file ({name}) explicitly"
        )
    return Path(folder).expanduser() / name


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """Read a result written by :func:`write_json`; a missing, unreadable or broken file, or one
    whose top level is not a JSON object, is a CompareError naming the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CompareError(f"result file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as err:
        raise CompareError(f"result file {str(path)!r} is not valid JSON: {err}") from None
    except UnicodeDecodeError:
        raise CompareError(f"result file {str(path)!r} is not UTF-8 text") from None
    except OSError as err:
        raise CompareError(f"result file {str(path)!r} cannot be read: {err}") from None
    if not isinstance(data, dict):
        raise CompareError(f"result file {str(path)!r} must hold a JSON object; got a {type(data).__name__}")
    return data


def weights_digest(directory: str | os.PathLike) -> str | None:
    """sha256 over the ``*.safetensors`` files of a local model directory (sorted by name), so a
    result names the exact weights it was measured on; None when there are none."""
    if not Path(directory).is_dir():
        raise CompareError(f"weights directory {str(directory)!r} does not exist")
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
    if not isinstance(text, str):
        raise CompareError(f"text must be a str; got {type(text).__name__}")
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def build_result(
    *,
    tool: str,
    packages: Iterable[str],
    model: dict[str, Any],
    inputs: dict[str, Any],
    peak_label: str,
    runs: list[dict[str, Any]],
    absent: Sequence[dict[str, str]] = (),
) -> dict[str, Any]:
    """The ``kvbench.compare/2`` document: stamp, model, inputs, what each column measures, and
    one entry per run (``{"name", "settings", "rows"}``: the short- and long-context runs).

    ``absent``: ``{"name", "kind", "reason"}`` for every candidate that could not run here.
    """
    if not isinstance(runs, list):
        raise CompareError(
            f"runs must be a list of {{'name', 'settings', 'rows'}} dicts; got {type(runs).__name__}"
        )
    for i, run in enumerate(runs):
        if not isinstance(run, dict) or not isinstance(run.get("name"), str):
            raise CompareError(f"runs[{i}] must be a dict with a 'name'; got {run!r:.80}")
        check_rows(run.get("rows"), f"runs[{i}]['rows']")
    for i, item in enumerate(absent):
        if not isinstance(item, dict) or not all(
            isinstance(item.get(k), str) for k in ("name", "kind", "reason")
        ):
            raise CompareError(
                f"absent[{i}] must be a dict of strings 'name', 'kind', 'reason'; got {item!r:.80}"
            )
    return {
        "schema": SCHEMA,
        "tool": tool,
        "stamp": environment_stamp(packages),
        "model": model,
        "inputs": inputs,
        "measures": {**MEASURES, "peak_label": peak_label},
        "runs": runs,
        "absent": list(absent),
    }


def run_of(result: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The run called ``name`` ("short" or "long") of a compare document, or None."""
    return next((run for run in check_result(result)["runs"] if run["name"] == name), None)
