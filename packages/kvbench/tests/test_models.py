"""embedded_model_path: env var first, then a walk up from the working directory and the package."""

from __future__ import annotations

import pytest
from kvbench import models


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(models.ENV_VAR, raising=False)


def _make_model(root):
    path = root / "benchmarks" / "model" / "tiny-qwen3"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_env_var_wins(tmp_path, monkeypatch):
    model = tmp_path / "elsewhere"
    model.mkdir()
    (model / "config.json").write_text("{}")
    _make_model(tmp_path / "repo")
    monkeypatch.setenv(models.ENV_VAR, str(model))
    assert models.embedded_model_path(cwd=tmp_path / "repo") == model.resolve()


def test_env_var_without_config_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(models.ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        models.embedded_model_path()


def test_walks_up_from_the_working_directory(tmp_path, monkeypatch, no_env):
    model = _make_model(tmp_path / "repo")
    deep = tmp_path / "repo" / "packages" / "x" / "y"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert models.embedded_model_path() == model.resolve()


def test_walks_up_from_the_package_location(tmp_path, monkeypatch, no_env):
    model = _make_model(tmp_path / "repo")
    fake_file = tmp_path / "repo" / "packages" / "kvbench" / "src" / "kvbench" / "models.py"
    monkeypatch.setattr(models, "__file__", str(fake_file))
    outside = tmp_path / "outside"
    outside.mkdir()
    assert models.embedded_model_path(cwd=outside) == model.resolve()


def test_not_found_says_how_to_point_at_a_model(tmp_path, monkeypatch, no_env):
    monkeypatch.setattr(models, "__file__", str(tmp_path / "pkg" / "models.py"))
    with pytest.raises(FileNotFoundError, match=models.ENV_VAR):
        models.embedded_model_path(cwd=tmp_path)
