"""Each package builds a wheel that installs into a clean virtual environment and imports.

Runs in the ``bench`` environment (it needs ``hatchling``). Wheels are built with
``python -m hatchling build -t wheel``; each is installed with pip into its own fresh
``python -m venv``, next to the freshly built ``kvcache-spec`` wheel (named explicitly, so
pip never takes a same-named project from an index). A constraints file pins
``torch==2.13.0`` so pip takes the CPU build and never pulls a CUDA one. Inside the venv
the test imports the package from site-packages (not the source tree) and reads its
metadata: distribution name, version and extras.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (directory, distribution name, import name, extras, extras installed for the import test)
PACKAGES = [
    ("kvspec", "kvcache-spec", "kvspec", set(), ""),
    ("kvbench", "kvbench", "kvbench", {"plot", "convert"}, ""),
    (
        "palu-mlx",
        "palu-mlx",
        "palu_mlx",
        {"cpu", "cuda", "compare", "peers"},
        "[cpu,compare]" if sys.platform == "linux" else "[compare]",
    ),
    ("flashcodec-torch", "flashcodec-kv", "flashcodec", {"hf", "triton", "compare", "lossless"}, "[compare]"),
]
#: console script of each package with a compare extra (installed with it, so ``--list`` must work)
COMMANDS = {"palu-mlx": "palu-mlx", "flashcodec-kv": "flashcodec"}

PROBE = textwrap.dedent(
    """
    import importlib, importlib.metadata as md, json, sys
    dist, module = sys.argv[1], sys.argv[2]
    mod = importlib.import_module(module)
    meta = md.metadata(dist)
    print(json.dumps({
        "file": mod.__file__,
        "module_version": getattr(mod, "__version__", None),
        "name": meta["Name"],
        "version": md.version(dist),
        "extras": sorted(meta.get_all("Provides-Extra") or []),
        "requires": meta.get_all("Requires-Dist") or [],
    }))
    """
)


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise AssertionError(
            f"command failed ({result.returncode}): {' '.join(map(str, cmd))}\n"
            f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
        )
    return result


def _pyproject_version(directory: str) -> str:
    text = (REPO / "packages" / directory / "pyproject.toml").read_text()
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE).group(1)


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    for directory, *_ in PACKAGES:
        _run(
            [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(out)],
            cwd=REPO / "packages" / directory,
        )
    return out


def _wheel(wheel_dir: Path, dist: str) -> Path:
    found = sorted(wheel_dir.glob(f"{dist.replace('-', '_')}-*.whl"))
    assert len(found) == 1, f"expected one {dist} wheel in {wheel_dir}; found {found}"
    return found[0]


def test_wheels_are_built(wheel_dir):
    for directory, dist, _module, _, _ in PACKAGES:
        wheel = _wheel(wheel_dir, dist)
        assert wheel.name.startswith(f"{dist.replace('-', '_')}-{_pyproject_version(directory)}-py3-none-any")


def test_kvspec_wheel_ships_its_data(wheel_dir):
    import zipfile

    names = zipfile.ZipFile(_wheel(wheel_dir, "kvcache-spec")).namelist()
    assert "kvspec/data/vectors.npz" in names and "kvspec/data/manifest.json" in names
    assert "kvspec/py.typed" in names
    # the contract knows nothing of the compare harness
    assert not any(n.startswith("kvspec/") and n.split("/")[-1] in ("measure.py", "report.py") for n in names)


def test_kvbench_wheel_ships_its_text(wheel_dir):
    import zipfile

    names = zipfile.ZipFile(_wheel(wheel_dir, "kvbench")).namelist()
    assert "kvbench/data/heldout.txt" in names and "kvbench/py.typed" in names


@pytest.mark.slow
@pytest.mark.parametrize(
    ("directory", "dist", "module", "extras", "install_extras"), PACKAGES, ids=[p[1] for p in PACKAGES]
)
def test_wheel_installs_in_a_clean_venv(wheel_dir, tmp_path, directory, dist, module, extras, install_extras):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / ("Scripts" if sys.platform == "win32" else "bin") / "python"
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch==2.13.0\n")
    # the local wheels are named explicitly, so pip never takes a same-named project from an index
    requirements = [str(_wheel(wheel_dir, "kvcache-spec"))]
    if dist not in ("kvcache-spec", "kvbench") and "compare" in install_extras:
        requirements.append(str(_wheel(wheel_dir, "kvbench")))
    if dist != "kvcache-spec":
        requirements.append(f"{_wheel(wheel_dir, dist)}{install_extras}")
    _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--find-links",
            str(wheel_dir),
            "-c",
            str(constraints),
        ]
        + requirements,
        timeout=900,
    )
    # run from an empty directory so the source tree cannot shadow the installed package
    probe = _run([str(python), "-c", PROBE, dist, module], cwd=tmp_path, timeout=300)
    info = json.loads(probe.stdout.strip().splitlines()[-1])
    assert Path(info["file"]).resolve().is_relative_to(venv.resolve()), info["file"]
    assert info["name"] == dist
    assert info["version"] == _pyproject_version(directory)
    if info["module_version"] is not None:
        assert info["module_version"] == info["version"]
    assert set(info["extras"]) == extras
    if dist != "kvcache-spec":
        assert any(r.startswith("kvcache-spec") for r in info["requires"]), info["requires"]
    if dist in COMMANDS:
        # the compare extra brings kvbench: the console script lists the package's tiers
        script = venv / ("Scripts" if sys.platform == "win32" else "bin") / COMMANDS[dist]
        listed = _run([str(script), "compare", "--list"], cwd=tmp_path, timeout=600).stdout
        assert "tier  " in listed and "peer  " in listed, listed
    if dist == "kvbench":
        check = "from kvbench.cli import load_eval_text; text, path = load_eval_text(None); assert len(text) > 50_000"
        _run([str(python), "-c", check], cwd=tmp_path, timeout=300)
    if dist == "kvcache-spec":
        # the data travels in the wheel: vectors load and the reference passes a check
        check = (
            "from kvspec import load_vectors, ReferenceAdapter; from kvspec.conformance import conformance_items;"
            "vs = load_vectors(); assert len(vs) >= 18, len(vs);"
            "items = conformance_items(ReferenceAdapter(), vs[:1]); assert all(i.run() == 'passed' for i in items)"
        )
        _run([str(python), "-c", check], cwd=tmp_path, timeout=300)
