"""Where kvbench finds its inputs when the user names none: the embedded model and the held-out text.

The held-out text ships with kvbench (``kvbench/data/heldout.txt``: documents of the Python
standard library's documentation that the embedded model never saw in training), so a compare
runs anywhere. The embedded model (27 MB) does not ship in any wheel: it lives in the
repository, at ``benchmarks/model/tiny-qwen3/``, found by walking up from the working directory,
or wherever ``KVBENCH_EMBEDDED_MODEL`` points.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_VAR", "MODEL_RELATIVE_PATH", "embedded_model_path", "default_text_path"]

ENV_VAR = "KVBENCH_EMBEDDED_MODEL"
MODEL_RELATIVE_PATH = Path("benchmarks") / "model" / "tiny-qwen3"
_TEXT = Path(__file__).resolve().parent / "data" / "heldout.txt"


def default_text_path() -> Path:
    """The held-out text kvbench ships (UTF-8, documents separated by blank lines)."""
    return _TEXT


def _walk_up(start: Path) -> Path | None:
    for directory in (start, *start.parents):
        candidate = directory / MODEL_RELATIVE_PATH
        if (candidate / "config.json").is_file():
            return candidate
    return None


def embedded_model_path(cwd: Path | None = None) -> Path:
    """The directory of the embedded tiny model (it holds ``config.json`` and the weights).

    Looked up in this order:

    1. the environment variable ``KVBENCH_EMBEDDED_MODEL`` (a directory with ``config.json``);
    2. ``benchmarks/model/tiny-qwen3/`` in ``cwd`` (default: the working directory) or any parent;
    3. the same, walking up from this file (an editable install inside the repository).

    Raises ``FileNotFoundError`` saying how to point at a model when none is found, or when
    the environment variable names a directory without ``config.json``.
    """
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{ENV_VAR}={override!r} does not name a model directory: {path / 'config.json'} is missing"
            )
        return path
    for start in (Path(cwd) if cwd is not None else Path.cwd(), Path(__file__).resolve().parent):
        found = _walk_up(start.resolve())
        if found is not None:
            return found
    raise FileNotFoundError(
        f"the embedded model was not found: no {MODEL_RELATIVE_PATH}/config.json above the working "
        f"directory or the kvbench package. Run from inside the repository, or set {ENV_VAR} to a "
        "directory holding the model's config.json and weights."
    )
