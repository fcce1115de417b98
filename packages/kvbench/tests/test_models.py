"""embedded_model_path: the directory KVBENCH_EMBEDDED_MODEL names, and a clear error otherwise."""

from __future__ import annotations

import pytest
from kvbench import models


def _make_model(root):
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}")
    return root


def test_the_env_var_names_the_model(tmp_path, monkeypatch):
    model = _make_model(tmp_path / "elsewhere")
    monkeypatch.setenv(models.ENV_VAR, str(model))
    assert models.embedded_model_path() == model.resolve()
    assert models.resolve_model(models.EMBEDDED_MODEL) == str(model.resolve())


def test_env_var_without_config_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(models.ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        models.embedded_model_path()


@pytest.mark.parametrize("value", [None, ""])
def test_unset_says_how_to_point_at_the_model(tmp_path, monkeypatch, value):
    # a checkout's layout is no longer searched: a model where the repository keeps it is not found
    _make_model(tmp_path / "benchmarks" / "model" / "tiny-qwen3")
    monkeypatch.chdir(tmp_path)
    if value is None:
        monkeypatch.delenv(models.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(models.ENV_VAR, value)
    with pytest.raises(FileNotFoundError, match=f"{models.ENV_VAR}, which is not set"):
        models.embedded_model_path()
