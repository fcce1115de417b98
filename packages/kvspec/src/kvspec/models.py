"""Where the project's embedded tiny model lives: the one place that knows.

The benchmarks, the demo and the "real" test vectors use a small Qwen3-style model trained
and committed in ``benchmarks/models/tiny-qwen3/`` so nothing is downloaded at run time.
Installed packages do not ship it; point at a copy with ``KVSPEC_EMBEDDED_MODEL``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_VAR", "MODEL_RELATIVE_PATH", "embedded_model_path"]

ENV_VAR = "KVSPEC_EMBEDDED_MODEL"
MODEL_RELATIVE_PATH = Path("benchmarks") / "models" / "tiny-qwen3"


def _walk_up(start: Path) -> Path | None:
    for directory in (start, *start.parents):
        candidate = directory / MODEL_RELATIVE_PATH
        if (candidate / "config.json").is_file():
            return candidate
    return None


def embedded_model_path(cwd: Path | None = None) -> Path:
    """The directory of the embedded tiny model (it holds ``config.json`` and the weights).

    Looked up in this order:

    1. the environment variable ``KVSPEC_EMBEDDED_MODEL`` (a directory with ``config.json``);
    2. ``benchmarks/models/tiny-qwen3/`` in ``cwd`` (default: the working directory) or any parent;
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
        f"directory or the kvspec package. Run from inside the repository, or set {ENV_VAR} to a "
        "directory holding the model's config.json and weights."
    )
