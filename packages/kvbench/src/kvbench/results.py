"""Results files: the compare document's layout, its stamp (machine, versions, date), strict
JSON, and digests of the weights and text a result was measured on.

:class:`CompareError` lives here, at the bottom of kvbench, because every module (starting with
:func:`read_json`) reports a mistake the user can fix with it.

Only numpy, kvspec and the standard library are imported.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from kvspec import KVSpecError

__all__ = [
    "SCHEMA",
    "CompareError",
    "build_result",
    "environment_stamp",
    "to_jsonable",
    "write_json",
    "read_json",
    "weights_digest",
    "text_digest",
    "run_of",
]


class CompareError(KVSpecError, ValueError):
    """A mistake in a compare command (bad path, unknown tier, unusable model): one clear line."""


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
    """Write ``data`` as indented, strict JSON (parent folders created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_jsonable(data), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return out


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """Read a result written by :func:`write_json`; a missing or broken file is a CompareError."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CompareError(f"result file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as err:
        raise CompareError(f"result file {str(path)!r} is not valid JSON: {err}") from None


def weights_digest(directory: str | os.PathLike) -> str | None:
    """sha256 over the ``*.safetensors`` files of a local model directory (sorted by name), so a
    result names the exact weights it was measured on; None when there are none."""
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
    from .protocol import MEASURES

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
    return next((run for run in result.get("runs", []) if run["name"] == name), None)
