"""The calibration file: what it holds, how it is written, read and checked, and which model it fits.

A :class:`Calibration` holds, per layer and per KV head, the latent transform of the keys and of
the values (:class:`TensorCalibration`: ``basis [H, D, D]`` with columns by descending latent
variance, ``mean [H, D]``, the latent ``variance [H, D]`` and, for weighted fits, a ``decoder``).
:meth:`Calibration.save` writes them as safetensors whose metadata identifies the model
(:func:`model_identity`: architecture, layer count, KV heads, head dims, a digest and a
dtype-independent fingerprint of the weights that make keys and values) and carries a checksum;
:meth:`Calibration.load` checks every entry; :meth:`Calibration.check_model` rejects a file made
for another model. Fitting one is :mod:`palu_mlx.calibration.fit`'s job.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError, KVDataError, KVSpecError
from mlx.utils import tree_flatten

from ..integrity import CHECKSUM_KEY, digest
from ..lowrank import check_projection_arrays
from ..models import check_model, model_kv_dims

__all__ = [
    "Calibration",
    "TensorCalibration",
    "kv_weights_digest",
    "kv_weights_fingerprint",
    "model_identity",
    "CALIBRATION_FORMAT",
    "WEIGHTINGS",
]

CALIBRATION_FORMAT = "palu-mlx.calibration.v1"
#: how calibration weighs coding errors: "none" (plain squared error of keys and values) or
#: "attention" (key errors as the queries see them, value errors as ``o_proj`` does)
WEIGHTINGS: tuple[str, ...] = ("none", "attention")


def _kv_parameters(model: Any) -> list[tuple[str, mx.array]]:
    check_model(model)
    # the parameters that make keys and values from a layer's input (quantized: with scales, biases)
    params = tree_flatten(model.parameters())
    kv = [(n, a) for n, a in params if any(p in n for p in ("k_proj", "v_proj", "k_norm"))]
    return sorted(kv, key=lambda x: x[0])


def kv_weights_digest(model: Any) -> str:
    """sha256 over names, shapes and bytes of the key / value path's parameters, as the model holds them.

    Informative (recorded in the file): it changes with the dtype the model was loaded in. The
    check that a file fits a model uses :func:`kv_weights_fingerprint`, which does not.
    """
    h = hashlib.sha256()
    for name, arr in _kv_parameters(model):
        a = np.array(arr.astype(mx.float32) if arr.dtype == mx.bfloat16 else arr)
        h.update(f"{name}:{a.shape}:{arr.dtype}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def kv_weights_fingerprint(model: Any) -> dict[str, list[float]]:
    """Name -> ``[*shape, sum w^2, sum w*rho]`` per key / value path parameter (float64; rho seeded +-1).

    Unchanged (to ~1e-3 relative) when the same weights are cast to another float dtype, so a
    calibration made on a float32 model serves its bfloat16 / float16 copies; other weights
    (another checkpoint, another seed) move these sums far more.
    """
    out = {}
    for name, arr in _kv_parameters(model):
        a = np.array(arr if arr.dtype == mx.uint32 else arr.astype(mx.float32), dtype=np.float64).reshape(-1)
        rho = np.random.default_rng(a.size).choice((-1.0, 1.0), size=a.size)
        out[name] = [*map(float, arr.shape), float(a @ a), float(a @ rho)]
    return out


def _whole_fingerprint(model: Any, theirs: dict[str, list[float]], shard: Any) -> dict[str, list[float]]:
    """:func:`kv_weights_fingerprint` of the whole tensor-parallel model, from this rank's shard.

    ``sharded_load`` splits a key / value projection's rows (its first axis) into the ranks'
    contiguous slices; a parameter whose first axis is the ``world``-th part of the file's is such a
    slice. Its rows are a contiguous run of the whole parameter's flattened values, so its share of
    ``sum w^2`` and of ``sum w*rho`` (with the whole parameter's ``rho``, cut at the same run) add up
    over the ranks to the whole model's. Parameters every rank holds whole (``k_norm``) count once.
    """
    names, shapes, parts = [], [], []
    for name, arr in _kv_parameters(model):
        a = np.array(arr if arr.dtype == mx.uint32 else arr.astype(mx.float32), dtype=np.float64).reshape(-1)
        local = [float(n) for n in arr.shape]
        full = list(theirs.get(name, []))[:-2]
        sliced = (
            len(full) == len(local) > 0
            and full[0] == local[0] * shard.world
            and full[1:] == local[1:]
            and shard.world > 1
        )
        if sliced:
            n = a.size * shard.world
            rho = np.random.default_rng(n).choice((-1.0, 1.0), size=n)[
                shard.rank * a.size : (shard.rank + 1) * a.size
            ]
            shapes.append([local[0] * shard.world, *local[1:]])
            parts.append([a @ a, a @ rho])
        else:
            rho = np.random.default_rng(a.size).choice((-1.0, 1.0), size=a.size)
            shapes.append(local)
            parts.append([a @ a, a @ rho] if shard.rank == 0 else [0.0, 0.0])
        names.append(name)
    sums = shard.all_sum(np.array(parts, dtype=np.float64).reshape(-1, 2)) if parts else np.zeros((0, 2))
    return {n: [*shape, float(s[0]), float(s[1])] for n, shape, s in zip(names, shapes, sums, strict=True)}


def _same_fingerprint(a: dict[str, list[float]], b: dict[str, list[float]]) -> bool:
    if a.keys() != b.keys():
        return False
    for name in a:
        x, y = np.array(a[name]), np.array(b[name])
        if x.shape != y.shape:
            return False
        # shapes exactly, sums of squares to 1e-2 relative, the signed sum to 1e-2 of the norm
        norm = np.sqrt(max(x[-2], y[-2], 1e-30))
        if not (np.allclose(x[:-1], y[:-1], rtol=1e-2, atol=0) and abs(x[-1] - y[-1]) <= 1e-2 * norm):
            return False
    return True


def model_identity(model: Any) -> dict[str, Any]:
    """What a calibration file records about its model: architecture, shapes and the K/V weights digest."""
    head_dim, n_kv = model_kv_dims(model)
    args = getattr(model, "args", None)
    return {
        "architecture": str(getattr(args, "model_type", None) or type(model).__module__),
        "n_layers": len(model.layers),
        "n_kv_heads": n_kv,
        "head_dim": head_dim,
        "kv_weights_sha256": kv_weights_digest(model),
        "kv_weights_fingerprint": kv_weights_fingerprint(model),
    }


@dataclass(frozen=True)
class TensorCalibration:
    """Keys or values of one layer.

    Attributes:
        basis: ``[H, D, D]`` float32, per KV head: the encoder, columns by descending latent
            variance (orthonormal when unweighted).
        mean: ``[H, D]`` float32.
        variance: ``[H, D]`` float32, variance of the latents along each basis column (descending).
        decoder: ``[H, D, D]`` float32 or None: rebuilds ``x = μ + latents decoderᵀ`` (weighted
            fits); None rebuilds with ``basis`` (orthonormal, unweighted fits).
    """

    basis: mx.array
    mean: mx.array
    variance: mx.array
    decoder: mx.array | None = None

    def __post_init__(self) -> None:
        # read from a file, so every mismatch is the file's fault: KVDataError
        check_projection_arrays(
            "TensorCalibration",
            self.arrays(),
            scale="variance",
            heads="H",
            dtype_error=KVDataError,
            shape_error=KVDataError,
        )

    def arrays(self) -> dict[str, mx.array]:
        out = {"basis": self.basis, "mean": self.mean, "variance": self.variance}
        if self.decoder is not None:
            out["decoder"] = self.decoder
        return out


@dataclass(frozen=True)
class Calibration:
    """Per-layer key and value calibrations of one model (None for layers palu does not cache).

    Attributes:
        model: :func:`model_identity` of the model it was fitted on.
        keys, values: one :class:`TensorCalibration` (or None) per layer.
        pre_rope: whether the keys were recorded before RoPE.
        tokens: calibration tokens seen per layer.
        text_sha256: sha256 of the calibration text.
        weighting: one of :data:`WEIGHTINGS`, how the bases were fitted (files from before the
            option read as ``"none"``).
        compute_dtype: the dtype the model's forward passes ran in while recording (e.g.
            ``"float32"``, ``"bfloat16"``); None where not recorded (files from before it was).
    """

    model: dict[str, Any]
    keys: list[TensorCalibration | None]
    values: list[TensorCalibration | None]
    pre_rope: bool
    tokens: int
    text_sha256: str
    weighting: str = "none"
    compute_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise KVConfigError(
                f"weighting={self.weighting!r} must be one of {', '.join(map(repr, WEIGHTINGS))}"
            )

    def save(self, path: str | Path) -> None:
        """Write safetensors: ``<layer>.<key|value>.<basis|mean|variance[|decoder]>`` and a JSON header."""
        arrays = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            for prefix, t in (("key", k), ("value", v)):
                if t is not None:
                    arrays.update({f"{i}.{prefix}.{n}": a for n, a in t.arrays().items()})
        meta = {
            "format": CALIBRATION_FORMAT,
            "model": json.dumps(self.model, sort_keys=True),
            "pre_rope": json.dumps(self.pre_rope),
            "tokens": str(self.tokens),
            "text_sha256": self.text_sha256,
            "weighting": self.weighting,
        }
        if self.compute_dtype is not None:
            meta["compute_dtype"] = self.compute_dtype
        meta[CHECKSUM_KEY] = digest(arrays, meta)
        if not isinstance(path, (str, Path)) or not str(path):
            raise KVConfigError(f"path={path!r} must be a non-empty str or Path")
        try:
            mx.save_safetensors(str(path), arrays, meta)
        except (OSError, RuntimeError, ValueError) as exc:
            raise KVDataError(f"calibration file {str(path)!r} cannot be written: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read a file written by :meth:`save`.

        ``KVConfigError`` when the file cannot be read or is not a calibration file;
        ``KVDataError`` naming the file when it has no checksum or its checksum does not match, and
        naming the entry when its content is corrupt or does not match its own header (layer count, head count, head dims, finite values).
        """
        where = f"palu_calibration={str(path)!r}"
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
        except (OSError, RuntimeError, ValueError) as exc:
            raise KVConfigError(f"{where} cannot be read: {exc}") from None
        if not isinstance(arrays, dict) or meta.get("format") != CALIBRATION_FORMAT:
            raise KVConfigError(
                f"{where} is not a palu-mlx calibration file "
                f"(format {meta.get('format')!r}; expected {CALIBRATION_FORMAT!r})"
            )
        stored = meta.pop(CHECKSUM_KEY, None)
        if stored is None:
            raise KVDataError(
                f"{where} has no {CHECKSUM_KEY!r} entry (Calibration.save writes one): it cannot be "
                "verified, so it is not loaded"
            )
        if stored != digest(arrays, meta):
            raise KVDataError(
                f"{where} is corrupt: checksum mismatch (its arrays or header changed after it was written)"
            )
        try:
            return cls._from_file(arrays, meta)
        except (KVSpecError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise KVDataError(f"{where} is corrupt: {exc}") from None

    @classmethod
    def _from_file(cls, arrays: dict[str, mx.array], meta: dict[str, str]) -> Calibration:
        # any KeyError / JSONDecodeError / ValueError here is a corrupt file; load() names it
        model = json.loads(meta["model"])
        if not isinstance(model, dict):
            raise KVDataError("the 'model' header is not a JSON object")
        n, n_kv, head_dim = model["n_layers"], model["n_kv_heads"], model["head_dim"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise KVDataError(f"the header's n_layers={n!r} is not a positive int")
        pre_rope = json.loads(meta["pre_rope"])
        if not isinstance(pre_rope, bool):
            raise KVDataError(f"the header's pre_rope={pre_rope!r} is not true or false")
        tokens = int(meta["tokens"])
        weighting = meta.get("weighting", "none")  # files from before the option were fitted unweighted
        if weighting not in WEIGHTINGS:
            raise KVDataError(f"the header's weighting={weighting!r} is not one of {', '.join(WEIGHTINGS)}")
        tensors: dict[tuple[int, str], dict[str, mx.array]] = {}
        for key, arr in arrays.items():
            parts = key.split(".")
            if (
                len(parts) != 3
                or not parts[0].isdigit()
                or int(parts[0]) >= n
                or parts[1] not in ("key", "value")
                or parts[2] not in ("basis", "mean", "variance", "decoder")
            ):
                raise KVDataError(
                    f"array {key!r} is not '<layer below {n}>.<key|value>.<basis|mean|variance|decoder>'"
                )
            tensors.setdefault((int(parts[0]), parts[1]), {})[parts[2]] = arr
        for (layer, prefix), fields in sorted(tensors.items()):
            if set(fields) - {"decoder"} != {"basis", "mean", "variance"}:
                raise KVDataError(
                    f"layer {layer} {prefix}: has arrays {sorted(fields)}; needs basis, mean, variance "
                    "(and a decoder for weighted fits)"
                )
            if (layer, "value" if prefix == "key" else "key") not in tensors:
                raise KVDataError(f"layer {layer} has {prefix} arrays but not the other tensor's")
        keys = [TensorCalibration(**tensors[(i, "key")]) if (i, "key") in tensors else None for i in range(n)]
        values = [
            TensorCalibration(**tensors[(i, "value")]) if (i, "value") in tensors else None for i in range(n)
        ]
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k is None:
                continue
            if n_kv is not None and (k.basis.shape[0] != n_kv or v.basis.shape[0] != n_kv):
                raise KVDataError(
                    f"layer {i}: {k.basis.shape[0]} / {v.basis.shape[0]} heads; the header says {n_kv}"
                )
            if head_dim is not None and k.basis.shape[1] != head_dim:
                raise KVDataError(f"layer {i}: key head dim {k.basis.shape[1]}; the header says {head_dim}")
        present = [a for t in keys + values if t is not None for a in t.arrays().values()]
        if not present:
            raise KVDataError("the file holds no layer's arrays")
        if not mx.all(mx.stack([mx.all(mx.isfinite(a)) for a in present])).item():
            raise KVDataError("an array contains NaN or infinity")
        compute_dtype = meta.get("compute_dtype")  # files from before it was recorded have none
        return cls(model, keys, values, pre_rope, tokens, str(meta["text_sha256"]), weighting, compute_dtype)

    def check_model(self, model: Any, source: str = "palu_calibration", shard: Any = None) -> None:
        """Raise ``KVConfigError`` naming what differs if ``model`` is not the calibrated model.

        ``shard`` (a :class:`~palu_mlx.distributed.HeadShard`): ``model`` is this rank's share of a
        tensor-parallel model; it is compared as the whole model it is part of (its KV head count,
        and the fingerprint of the whole K/V weights, summed over the ranks). Every rank must call
        this at the same point (it is a collective).
        """
        check_model(model)
        ours = model_identity(model)
        if shard is not None:
            ours["n_kv_heads"] = shard.total
            ours["kv_weights_fingerprint"] = _whole_fingerprint(
                model, self.model.get("kv_weights_fingerprint", {}), shard
            )
        exact = ("architecture", "n_layers", "n_kv_heads", "head_dim")
        diffs = [
            f"{k} {self.model.get(k)!r} (file) != {ours[k]!r} (model)"
            for k in exact
            if self.model.get(k) != ours[k]
        ]
        theirs = self.model.get("kv_weights_fingerprint", {})
        if not diffs and not _same_fingerprint(theirs, ours["kv_weights_fingerprint"]):
            where = "" if shard is None else " (this rank's shard; its sha256 covers its own slice)"
            diffs.append(
                "kv_weights (the key / value projection weights) differ: file sha256 "
                f"{self.model.get('kv_weights_sha256')}, model sha256 {ours['kv_weights_sha256']}{where}"
            )
        if diffs:
            raise KVConfigError(f"{source}: the calibration was made for another model: {'; '.join(diffs)}")
