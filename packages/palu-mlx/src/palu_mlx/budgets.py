"""Bits per layer, keys against values, from a model's measured sensitivity.

One water-filling level per layer (:class:`~palu_mlx.coders.WaterFilling`) spends the same bits
on every layer and weighs a unit of key error like a unit of value error. On a real model the
layers are not alike: on SmolLM2-135M, coding one layer's values at 2 bits moves the output
distribution over two hundred times more than coding another layer's keys
(``benchmarks/results/palu_sensitivity.json``). This module measures that once per model and
spends the bits where they buy the most.

**Measuring** (:func:`measure_sensitivity`): with every other layer exact, one layer's keys (or
values) are coded at ``bits`` code bits per element (the prefill-fitted coder: full-rank
projection per KV head, water-filled widths, fixed quantizers with a per-token scale, the first
tokens exact, keys before RoPE where the model supports it) and the KL divergence of the model's
next-token distributions from the exact run's is recorded, with the squared error the coding
left (per token and head). ``kl / error`` is that tensor's *weight*: what a unit of squared
error in it costs in KL, to first order.

**Spending** (:meth:`SensitivityProfile.allocate`): under the high-rate model a channel of
variance ``λ`` coded at ``b`` bits leaves ``λ 4^-b``, so the expected KL is
``Σ weight · λ · 4^-b`` over every channel of every layer; one reverse water-filling level over
``weight · λ`` (the profile's variances) minimises it at a given average. Each layer gets the
bits that level gives its keys and values, as a :class:`~palu_mlx.coders.WaterFilling` whose
``bits`` are the layer's share and whose ``key_weight`` / ``value_weight`` are the weights: at
the prefill the layer water-fills its own variances with those weights, so a text whose
statistics differ from the measurement's still spends the layer's bits on its channels.

The profile is per model, measured once and written beside the model as a small JSON file
(:func:`profile_path`), the way a calibration file is; it holds no projection or quantizer, only
2 numbers and 2 variance spectra per layer. A cache cannot compute the weights itself at the
prefill: what a layer's error costs depends on what the later layers do with it, which no layer
sees. The part a cache can compute, weighing each tensor by its relative error instead of its
squared error, is :attr:`~palu_mlx.coders.WaterFilling.relative` (no file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError, KVDataError

from .coders.water_filling import WaterFilling, fit_variances, fixed_coder, is_bit_budget
from .lowrank import project, reconstruct
from .mixed_bit import water_fill
from .models import check_model, model_kv_dims
from .rope import Rotary, model_rotaries

__all__ = [
    "PROFILE_FORMAT",
    "SensitivityProfile",
    "code_tensor",
    "measure_sensitivity",
    "profile_path",
    "spread_windows",
    "WEIGHT_FLOOR",
]

#: the ``format`` entry of a profile file
PROFILE_FORMAT = "palu-sensitivity/1"
#: a weight is raised to at least this fraction of the median weight: a layer measured as
#: insensitive at one budget is not starved to zero bits, where the first-order model (KL in
#: proportion to squared error) no longer holds
WEIGHT_FLOOR = 0.01


def profile_path(model_dir: str | os.PathLike) -> Path:
    """Where a model's profile lives: ``<model directory>.palu-sensitivity.json`` beside it."""
    p = Path(model_dir)
    return p.with_name(p.name + ".palu-sensitivity.json")


def spread_windows(tokens: Sequence[int], windows: int, length: int) -> list[list[int]]:
    """``windows`` non-overlapping windows of ``length`` token ids spread evenly over ``tokens``, the
    first at the start (kvbench's rule for its text windows, which the benchmarks' profiles used).
    Raises ``KVConfigError`` when the text is too short or a count is not a positive int."""
    for name, value in (("windows", windows), ("length", length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KVConfigError(f"{name}={value!r} must be a positive integer")
    if len(tokens) < windows * length:
        raise KVConfigError(
            f"the text has {len(tokens)} tokens; {windows} window(s) of {length} tokens need "
            f"{windows * length}: give a longer text or fewer / shorter windows"
        )
    stride = (len(tokens) - length) // (windows - 1) if windows > 1 else 0
    return [list(tokens[i * stride : i * stride + length]) for i in range(windows)]


def _floats(values: Any, name: str, n: int | None = None, positive: bool = False) -> tuple[float, ...]:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise KVConfigError(f"{name} must be a list of numbers; got {type(values).__name__}") from None
    if arr.ndim != 1 or arr.size == 0 or (n is not None and arr.size != n):
        want = "a non-empty list" if n is None else f"{n} numbers"
        raise KVConfigError(f"{name} must be {want}; got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0 if positive else arr < 0):
        raise KVConfigError(
            f"{name} must hold finite numbers {'> 0' if positive else '>= 0'}; got {arr.tolist()}"
        )
    return tuple(float(v) for v in arr)


@dataclass(frozen=True)
class SensitivityProfile:
    """A model's measured sensitivity, per layer, keys and values apart.

    Attributes:
        model: what the profile was measured on (:func:`~palu_mlx.calibration.file.model_identity`
            fields: architecture, layer count, KV heads, head dim; more keys are kept as given).
        bits: the code bits per element each tensor was coded at when measured.
        key_kl, value_kl: per layer, the mean KL (nats) of the next-token distributions when only
            that layer's keys (values) were coded.
        key_error, value_error: per layer, the squared error per token and head that coding left.
        key_variances, value_variances: per layer, the latent channel variances (averaged over the
            heads, descending) of the measurement's text: what :meth:`allocate` spreads bits over.
    """

    model: dict[str, Any]
    bits: float
    key_kl: tuple[float, ...]
    value_kl: tuple[float, ...]
    key_error: tuple[float, ...]
    value_error: tuple[float, ...]
    key_variances: tuple[tuple[float, ...], ...]
    value_variances: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.model, dict) or not isinstance(self.model.get("n_layers"), int):
            raise KVConfigError(f"model={self.model!r:.200} must be a dict with an int 'n_layers'")
        n = self.model["n_layers"]
        if n < 1:
            raise KVConfigError(f"model n_layers={n} must be >= 1")
        if not is_bit_budget(self.bits):
            raise KVConfigError(f"bits={self.bits!r} must be a number in (0, 8]")
        for name in ("key_kl", "value_kl"):
            object.__setattr__(self, name, _floats(getattr(self, name), name, n))
        for name in ("key_error", "value_error"):
            object.__setattr__(self, name, _floats(getattr(self, name), name, n, positive=True))
        for name in ("key_variances", "value_variances"):
            rows = getattr(self, name)
            if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or len(rows) != n:
                raise KVConfigError(f"{name} must be {n} lists of channel variances (one per layer)")
            object.__setattr__(self, name, tuple(_floats(r, f"{name}[{i}]") for i, r in enumerate(rows)))

    @property
    def n_layers(self) -> int:
        return int(self.model["n_layers"])

    def weights(self) -> tuple[np.ndarray, np.ndarray]:
        """Per layer, what a unit of squared error in the keys (values) costs: ``kl / error``,
        floored at :data:`WEIGHT_FLOOR` of the median and scaled so that the median is 1."""
        w = np.array([self.key_kl, self.value_kl]) / np.array([self.key_error, self.value_error])
        median = float(np.median(w))
        if median <= 0:  # nothing measured moved the output: every tensor alike
            return np.ones(self.n_layers), np.ones(self.n_layers)
        w = np.maximum(w, WEIGHT_FLOOR * median) / median
        return w[0], w[1]

    def allocate(self, bits: float, token_scale: bool = True) -> list[WaterFilling]:
        """One coder per layer spending ``bits`` code bits per element on average over every layer's
        keys and values (one water-filling level over the weighted variances), as
        :class:`~palu_mlx.coders.WaterFilling` with the layer's share and the weights."""
        if not is_bit_budget(bits):
            raise KVConfigError(f"bits={bits!r} must be a number in (0, 8] (code bits per element)")
        wk, wv = self.weights()
        spectra = []
        for i in range(self.n_layers):
            spectra += [wk[i] * np.array(self.key_variances[i]), wv[i] * np.array(self.value_variances[i])]
        dims = [len(s) for s in spectra]
        widths = water_fill(spectra, int(round(bits * sum(dims))))
        out = []
        for i in range(self.n_layers):
            layer_bits = int(widths[2 * i].sum() + widths[2 * i + 1].sum())
            share = max(layer_bits, 1) / (dims[2 * i] + dims[2 * i + 1])
            # the weights are per unit of squared error: never the automatic relative weighing
            out.append(WaterFilling(min(share, 8.0), token_scale, float(wk[i]), float(wv[i]), relative=False))
        return out

    def check_model(self, model: Any) -> None:
        """Raise ``KVConfigError`` naming what differs when ``model``'s shape is not the profile's."""
        check_model(model)
        head_dim, n_kv = model_kv_dims(model)
        ours = {"n_layers": len(model.layers), "n_kv_heads": n_kv, "head_dim": head_dim}
        for key, value in ours.items():
            if key in self.model and self.model[key] != value:
                raise KVConfigError(
                    f"the sensitivity profile was measured on a model with {key}={self.model[key]}; "
                    f"this model has {key}={value}"
                )

    # ------------------------------------------------------------------ files
    def to_json(self) -> str:
        return json.dumps({"format": PROFILE_FORMAT, **asdict(self)}, indent=1)

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON (through a temporary file, so a failed write leaves none)."""
        path = Path(path)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SensitivityProfile:
        """Read a file written by :meth:`save`; ``KVDataError`` naming the file when it is not one."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise KVDataError(f"{path}: not a readable sensitivity profile ({exc})") from None
        if not isinstance(data, dict) or data.pop("format", None) != PROFILE_FORMAT:
            raise KVDataError(f"{path}: not a sensitivity profile (format must be {PROFILE_FORMAT!r})")
        names = {
            "model",
            "bits",
            "key_kl",
            "value_kl",
            "key_error",
            "value_error",
            "key_variances",
            "value_variances",
        }
        if set(data) != names:
            raise KVDataError(f"{path}: a profile has exactly the fields {sorted(names)}; got {sorted(data)}")
        try:
            return cls(**data)
        except KVConfigError as exc:
            raise KVDataError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------- measurement
def code_tensor(
    x: mx.array, bits: float, *, sink_tokens: int = 4, rotary: Rotary | None = None, token_scale: bool = True
) -> tuple[mx.array, float, np.ndarray]:
    """``x [B, H, S, D]`` through the prefill-fitted coder at ``bits`` code bits per element.

    One projection per KV head fitted on ``x``; ``round(bits * D)`` bits per token and head
    water-filled over its channels; fixed quantizers with (``token_scale``) a per-token scale. With
    ``rotary`` the keys (rotated at positions ``0..S-1``) are coded before RoPE. The first
    ``sink_tokens`` tokens are returned as given, as the cache holds them.

    Returns ``(reconstruction in x's dtype, squared error per token and head over the coded
    tokens, latent channel variances averaged over the heads, descending)``.
    """
    if not isinstance(x, mx.array) or x.ndim != 4:
        raise KVConfigError(
            f"x must be an mlx array [B, H, S, D]; got {getattr(x, 'shape', type(x).__name__)}"
        )
    if not isinstance(bits, (int, float)) or isinstance(bits, bool) or not 0 < bits <= 8:
        raise KVConfigError(f"bits={bits!r} must be a number in (0, 8]")
    src = x if rotary is None else rotary.unrotate(x, 0)
    proj, head_var = fit_variances(src, x.shape[1], None)
    (widths,) = water_fill([head_var.mean(axis=0)], int(round(bits * x.shape[-1])))
    proj, coder = fixed_coder(proj, head_var, widths, head_var, token_scale, x.dtype)
    latents = coder.decode(coder.encode(project(src, proj)))
    rec = reconstruct(latents, proj, mx.float32)
    if rotary is not None:
        rec = rotary.rotate(rec, 0)
    rec = rec.astype(x.dtype)
    if sink_tokens:
        m = min(sink_tokens, x.shape[2])
        rec = mx.concatenate([x[..., :m, :], rec[..., m:, :]], axis=2)
    m = min(sink_tokens, x.shape[2])
    diff = (rec[..., m:, :].astype(mx.float32) - x[..., m:, :].astype(mx.float32)) ** 2
    error = float(mx.mean(mx.sum(diff, axis=-1)).item()) if x.shape[2] > m else 0.0
    return rec, error, np.sort(head_var.mean(axis=0))[::-1].copy()


def _log_probs(model: Any, tokens: list[int], scored: int, cache: list[Any]) -> np.ndarray:
    z = model(mx.array(tokens)[None], cache=cache)[0, -scored - 1 : -1].astype(mx.float32)
    return np.array(z - mx.logsumexp(z, axis=-1, keepdims=True), dtype=np.float64)


class _Wrapped:
    """Stands in for a model's layer: every attribute the model reads (``use_sliding``, ...) is the layer's."""

    def __init__(self, layer: Any):
        self.layer = layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["layer"], name)


class _Recorded(_Wrapped):
    """A layer that runs as given and keeps its output (the exact run's hidden states)."""

    def __init__(self, layer: Any, out: list[mx.array]):
        super().__init__(layer)
        self.out = out

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        h = self.layer(*args, **kwargs)
        mx.eval(h)
        self.out.append(h)
        return h


class _Replayed(_Wrapped):
    """A layer before the probed one: its output is the exact run's (no work repeated)."""

    def __init__(self, layer: Any, h: mx.array):
        super().__init__(layer)
        self.h = h

    def __call__(self, *_args: Any, **_kwargs: Any) -> mx.array:
        return self.h


class _LastRows:
    """The final norm on the last ``n`` positions only: the output head reads just the scored ones."""

    def __init__(self, norm: Any, n: int):
        self.norm, self.n = norm, n

    def __call__(self, h: mx.array) -> mx.array:
        return self.norm(h[:, -self.n :])


def _patched(model: Any, layers: dict[int, Any], scored: int):
    """Swap ``model.layers[i]`` for ``layers[i]`` (and the final norm for one on the scored rows,
    where the model has ``model.model.norm``); returns the undo."""
    held = {i: model.layers[i] for i in layers}
    for i, layer in layers.items():
        model.layers[i] = layer
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if norm is not None:
        inner.norm = _LastRows(norm, scored + 1)

    def undo() -> None:
        for i, layer in held.items():
            model.layers[i] = layer
        if norm is not None:
            inner.norm = norm

    return undo


def _window_log_probs(model: Any, tokens: list[int], scored: int, cache: list[Any], layers: dict[int, Any]):
    undo = _patched(model, layers, scored)
    try:
        return _log_probs(model, tokens, scored, cache)
    finally:
        undo()


def measure_sensitivity(
    model: Any,
    windows: Sequence[Sequence[int]],
    scored: int,
    bits: float = 2.0,
    *,
    sink_tokens: int = 4,
    pre_rope: bool = True,
    progress: Callable[[str], None] | None = None,
    kv_dtype: mx.Dtype | None = None,
) -> SensitivityProfile:
    """Code one layer's keys or values at a time (every other layer exact) and record the KL.

    Each window of token ids is read in one forward; the last ``scored`` positions' next-token
    distributions are compared with the exact run's. ``2 * layers + 1`` forwards per window;
    ``progress`` gets one line after each probe (``2 * layers`` per window). ``kv_dtype``: round
    every layer's keys and values to it as they are cached, in the exact run too (a 16-bit model
    run in float32 then codes and attends over what the 16-bit model caches); None: as computed.
    """
    from mlx_lm.models.cache import KVCache

    from .calibration.file import model_identity

    check_model(model)
    if not windows or any(len(w) <= scored + 1 for w in windows):
        raise KVConfigError(f"windows must be non-empty token lists longer than scored + 1 = {scored + 1}")
    head_dim = model_kv_dims(model)[0]
    rotaries = (model_rotaries(model, head_dim) if pre_rope else None) or [None] * len(model.layers)
    n = len(model.layers)
    found: dict[tuple[int, int], dict[str, Any]] = {}

    class Probe(KVCache):
        """An exact cache that codes what it is given when it is the probed layer."""

        def __init__(self, layer: int, which: int | None):
            super().__init__()
            self.layer, self.which = layer, which

        def update_and_fetch(self, keys, values):
            if kv_dtype is not None:
                keys, values = keys.astype(kv_dtype), values.astype(kv_dtype)
            if self.which is not None:
                kv = [keys, values]
                rotary = rotaries[self.layer] if self.which == 0 else None
                kv[self.which], error, var = code_tensor(
                    kv[self.which], bits, sink_tokens=sink_tokens, rotary=rotary
                )
                found[(self.layer, self.which)] = {"error": error, "variances": var}
                keys, values = kv
            return super().update_and_fetch(keys, values)

    kl = np.zeros((2, n))
    error = np.zeros((2, n))
    variances = [[np.zeros(head_dim) for _ in range(n)] for _ in range(2)]
    for w_index, tokens in enumerate(windows):
        tokens = list(tokens)
        # the exact run keeps every layer's output; a probe of layer l replays layers 0..l-1 from it
        hidden: list[mx.array] = []
        exact = {i: _Recorded(model.layers[i], hidden) for i in range(n)}
        base = _window_log_probs(model, tokens, scored, [Probe(i, None) for i in range(n)], exact)
        for layer in range(n):
            replay = {i: _Replayed(model.layers[i], hidden[layer - 1]) for i in range(layer)}
            for which in (0, 1):
                caches = [Probe(i, which if i == layer else None) for i in range(n)]
                logp = _window_log_probs(model, tokens, scored, caches, replay)
                k = np.maximum((np.exp(base) * (base - logp)).sum(axis=-1), 0.0).mean()
                kl[which, layer] += k / len(windows)
                got = found.pop((layer, which))
                error[which, layer] += got["error"] / len(windows)
                v = got["variances"]
                variances[which][layer] = variances[which][layer][: len(v)] + v / len(windows)
                if progress is not None:
                    progress(
                        f"window {w_index + 1}/{len(windows)} layer {layer} {'keys' if which == 0 else 'values'}: "
                        f"KL {k:.3g}"
                    )
    identity = model_identity(model)
    return SensitivityProfile(
        model={
            k: identity[k]
            for k in ("architecture", "n_layers", "n_kv_heads", "head_dim", "kv_weights_sha256")
        },
        bits=float(bits),
        key_kl=tuple(kl[0]),
        value_kl=tuple(kl[1]),
        key_error=tuple(np.maximum(error[0], 1e-30)),
        value_error=tuple(np.maximum(error[1], 1e-30)),
        key_variances=tuple(tuple(v) for v in variances[0]),
        value_variances=tuple(tuple(v) for v in variances[1]),
    )
