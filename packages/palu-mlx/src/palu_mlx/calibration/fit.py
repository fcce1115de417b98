"""Fitting a calibration: running a model over text and computing each layer's bases.

:func:`calibrate` runs a model over text (by default the text shipped in
``palu_mlx/data/calibration.txt``, never kvbench's held-out evaluation text), records every
layer's keys (before RoPE where the architecture supports it, see :mod:`palu_mlx.rope`) and
values as running per-head moments, and fits, per layer and per KV head, the eigenbasis of their
covariance (:func:`_fit`), returned as a :class:`~palu_mlx.calibration.file.Calibration`.

``weighting="attention"`` (``palu-mlx calibrate --weighting attention``) weighs coding errors
by what attention makes of them instead of by their plain size: a key error ``e`` moves the
scores by ``q·e`` (``E[(q·e)²] = eᵀ E[qqᵀ] e``, summed over the query heads sharing the KV
head, averaged over RoPE's rotation when keys are coded before it), a value error by ``W_o``
(``eᵀ Σ W_hᵀW_h e`` over the heads' slices of ``o_proj``). The weighted transform whitens that
metric (:func:`_fit`), so its encoder is not orthonormal and the file also holds each tensor's
decoder. On the embedded model it cuts the KL of a calibrated tier to 0.34-0.43 times the
unweighted one at the same bits (``benchmarks/results/palu_calibration_weighting.json``).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from kvspec import KVConfigError
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache
from tqdm import tqdm

from ..models import check_model, default_caches, model_kv_dims
from ..rope import Rotary, _pair_index, model_rotaries
from .file import WEIGHTINGS, Calibration, TensorCalibration, model_identity

__all__ = [
    "calibrate",
    "default_calibration_text",
    "COMPUTE_DTYPES",
    "DEFAULT_MAX_TOKENS",
    "METRIC_RIDGE",
]

#: what calibration runs the model's forward passes in: "auto" (float32 where a probe finds it at
#: least twice as fast as the model's 16-bit dtype), "float32", or "model" (the dtype it was loaded in)
COMPUTE_DTYPES: tuple[str, ...] = ("auto", "float32", "model")
#: tokens of calibration text used unless told otherwise (None: all)
DEFAULT_MAX_TOKENS: int | None = 4096
DATA = Path(__file__).resolve().parent.parent / "data" / "calibration.txt"


def default_calibration_text() -> str:
    """The calibration text shipped with the package (Python stdlib docstrings; see ``data/README.md``)."""
    return DATA.read_text(encoding="utf-8")


def _window_moments(x: mx.array) -> tuple[int, mx.array, mx.array, mx.array]:
    """``x [B, H, S, D]`` -> per head ``(count, shift [H, D], sum of x - shift [H, D], Gram of x - shift
    [H, D, D])``, float32, lazy; the shift is the window's mean as float32 computes it.

    Moments about the window's own mean keep float32 exact enough where the keys' means dwarf
    their spread (raw float32 second moments would lose the spread to rounding); the sum about
    the shift, small but not zero, carries the float32 mean's own rounding to :class:`_Moments`,
    which rebuilds the raw moments in float64. One batched matmul per tensor and window, left in
    the graph so that a window's every layer evaluates at once.
    """
    h, d = x.shape[1], x.shape[3]
    x = x.astype(mx.float32).transpose(1, 0, 2, 3).reshape(h, -1, d)  # [H, N, D]
    shift = x.mean(axis=1)
    centred = x - shift[:, None, :]
    return x.shape[1], shift, centred.sum(axis=1), centred.transpose(0, 2, 1) @ centred


class _Moments:
    """Float64 per-head count, sum and sum of outer products of one tensor over every window seen."""

    def __init__(self) -> None:
        self.count = 0
        self.total: np.ndarray | float = 0.0
        self.outer: np.ndarray | float = 0.0

    def add(self, count: int, shift: mx.array, residual: mx.array, gram: mx.array) -> None:
        """Fold in one window's :func:`_window_moments`: with ``c`` the shift and ``r = Σ(x - c)``,
        ``Σx = n c + r`` and ``Σxxᵀ = Σ(x - c)(x - c)ᵀ + c rᵀ + r cᵀ + n c cᵀ``."""
        c, r = np.array(shift, dtype=np.float64), np.array(residual, dtype=np.float64)
        cr = np.einsum("hd,he->hde", c, r)
        self.count += count
        self.total = self.total + count * c + r
        self.outer = (
            self.outer
            + np.array(gram, dtype=np.float64)
            + cr
            + cr.transpose(0, 2, 1)
            + count * np.einsum("hd,he->hde", c, c)
        )

    @property
    def stats(self) -> list:
        """``[count, sum [H, D], sum of outer products [H, D, D]]``, what :func:`_fit` reads."""
        return [self.count, self.total, self.outer]


class _Recorded(Exception):
    """Raised by the last recording cache: the rest of the forward pass (later layers, logits) is not needed."""


class _QueryTap(nn.Module):
    """Stands in for an attention layer's ``rope`` during calibration and remembers its calls.

    mlx-lm's attention rotates the queries, then the keys, then hands the keys to the cache,
    so at ``update_and_fetch`` the call before the keys' is the queries': its input is the
    pre-RoPE query, its output the post-RoPE one.
    """

    def __init__(self, rope: Any):
        super().__init__()
        self.inner = rope
        object.__setattr__(self, "calls", [])  # not a child module or parameter

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        out = self.inner(x, offset=offset)
        self.calls.append((x, out))
        return out


class _Recorder(mlx_cache.KVCache):
    """mlx-lm's KVCache that also records, per window, the per-head moments of K (pre-RoPE) and V
    and, given the layer's :class:`_QueryTap`, of the queries (pre-RoPE when the keys are).

    ``window`` receives lazy :func:`_window_moments` per tensor name; ``last`` marks the last
    recorded layer, which raises :class:`_Recorded` once its moments are in the graph.
    """

    def __init__(
        self,
        rotary: Rotary | None,
        window: dict[str, tuple],
        tap: _QueryTap | None = None,
        last: bool = False,
    ):
        super().__init__()
        self._rotary = rotary
        self._window = window
        self._tap = tap
        self._last = last

    def update_and_fetch(self, keys, values):
        k = keys if self._rotary is None else self._rotary.unrotate(keys, self.offset)
        self._window["key"] = _window_moments(k)
        self._window["value"] = _window_moments(values)
        if self._tap is not None:
            calls, self._tap.calls[:] = list(self._tap.calls), []
            if len(calls) < 2 or calls[-2][0].shape[2] != keys.shape[2]:
                raise KVConfigError(
                    "weighting='attention' could not see this layer's queries (its attention does not "
                    "rotate queries then keys right before the cache, as mlx-lm's llama / qwen families do)"
                )
            pre, post = calls[-2]
            self._window["query"] = _window_moments(pre if self._rotary is not None else post)
        if self._last:
            raise _Recorded
        return super().update_and_fetch(keys, values)


def _install_taps(model: Any, full: list[bool]) -> list[_QueryTap | None]:
    """Put a :class:`_QueryTap` in place of each recorded layer's ``self_attn.rope`` (undo: :func:`_remove_taps`)."""
    taps: list[_QueryTap | None] = []
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "self_attn", None)
        if not full[i]:
            taps.append(None)
            continue
        if not isinstance(getattr(attn, "rope", None), nn.Module) or getattr(attn, "o_proj", None) is None:
            _remove_taps(model, taps)
            raise KVConfigError(
                f"weighting='attention' needs each layer's self_attn.rope and self_attn.o_proj "
                f"(mlx-lm's llama / qwen families); layer {i} ({type(attn).__name__}) lacks them"
            )
        taps.append(_QueryTap(attn.rope))
        attn.rope = taps[-1]
    return taps


def _remove_taps(model: Any, taps: list[_QueryTap | None]) -> None:
    for layer, tap in zip(model.layers, taps, strict=False):
        if tap is not None:
            layer.self_attn.rope = tap.inner


def _group_sum(per_head: np.ndarray, n_kv: int) -> np.ndarray:
    """``[H_q, D, D]`` -> ``[H_kv, D, D]``: query head ``h`` reads KV head ``h // (H_q / H_kv)`` (mlx's GQA)."""
    h_q, d, _ = per_head.shape
    if h_q % n_kv:
        raise KVConfigError(f"{h_q} query heads cannot share {n_kv} KV heads evenly")
    return per_head.reshape(n_kv, h_q // n_kv, d, d).sum(axis=1)


def _query_metric(stats: list, n_kv: int, rotary: Rotary | None) -> np.ndarray:
    """``[H_kv, D, D]``: how the queries of each KV head's group probe a key error ``e``, ``E[(q·e)²] = eᵀMe``.

    ``M`` sums ``E[q qᵀ]`` over the query heads that share the KV head (GQA). For keys coded
    before RoPE (``rotary`` given) the query meets the key rotated by their relative position,
    so ``M`` is averaged over that rotation: each rotated channel pair gets the pair's mean
    query energy on both channels, cross terms between pairs vanish, and the unrotated channels
    keep their block.
    """
    n, _, s2 = stats
    metric = _group_sum(s2 / n, n_kv)  # uncentred: the score uses the query itself
    if rotary is None:
        return metric
    first, second = _pair_index(np.arange(rotary.dims // 2), rotary.dims, rotary.traditional)
    pair_energy = (metric[:, first, first] + metric[:, second, second]) / 2  # [H_kv, dims / 2]
    rotated = np.zeros(metric.shape[1], dtype=bool)
    rotated[first] = rotated[second] = True
    averaged = np.where(rotated[:, None] | rotated[None, :], 0.0, metric)  # unrotated block kept
    averaged[:, first, first] = averaged[:, second, second] = pair_energy
    return averaged


def _output_metric(o_proj: Any, n_kv: int, dim: int) -> np.ndarray:
    """``[H_kv, Dv, Dv]``: ``Σ W_hᵀ W_h`` over the query heads ``h`` sharing each KV head, ``W_h`` the
    head's column slice of ``o_proj`` (a value error ``e`` moves the layer's output by ``W_h (p·e)``)."""
    if hasattr(o_proj, "scales"):  # QuantizedLinear: the weights it multiplies by
        w = mx.dequantize(
            o_proj.weight, o_proj.scales, getattr(o_proj, "biases", None), o_proj.group_size, o_proj.bits
        )
    else:
        w = o_proj.weight
    w = np.array(w.astype(mx.float32), dtype=np.float64)  # [hidden, H_q * Dv]
    dv = dim
    if w.shape[1] % dv:
        raise KVConfigError(f"o_proj takes {w.shape[1]} inputs, not a multiple of the value head dim {dv}")
    heads = w.reshape(w.shape[0], -1, dv).transpose(1, 2, 0)  # [H_q, Dv, hidden]
    return _group_sum(heads @ heads.transpose(0, 2, 1), n_kv)


def _eigh(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.linalg.eigh`` of a batch of symmetric matrices, in float64 on mlx's CPU LAPACK.

    numpy's threaded OpenBLAS takes milliseconds per 64 x 64 matrix on a busy CPU, and far longer
    while a second OpenBLAS is preloaded for mlx (their thread pools compete); mlx's LAPACK call
    takes about one millisecond either way.
    """
    w, v = mx.linalg.eigh(mx.array(np.ascontiguousarray(a), dtype=mx.float64), stream=mx.cpu)
    return np.array(w), np.array(v)


#: ridge added to a weighting metric, as a share of its mean eigenvalue: directions the metric
#: barely sees still cost a little, so its inverse (the decoder) stays bounded
METRIC_RIDGE = 1e-3


def _fit(stats: list, metric: np.ndarray | None = None) -> TensorCalibration:
    """Per head: the latent transform of the recorded keys or values; with ``metric`` ``[H, D, D]``, weighted.

    Unweighted, it is the covariance ``C``'s eigenbasis (orthonormal: the transpose rebuilds).
    Weighted, coding errors are measured as ``eᵀ M e`` (:func:`_query_metric`, :func:`_output_metric`),
    with ``M`` scaled so that ``tr(M C) = tr(C)`` (a head's total variance, hence its share of the
    water-filled bits, is what it would be unweighted; only where the bits go inside it changes)
    plus a small ridge (:data:`METRIC_RIDGE`). With ``L = M^½`` and ``L C L = U Λ Uᵀ`` the
    latents ``z = Uᵀ L (x - μ)`` are uncorrelated with variances ``Λ`` and ``eᵀ M e = |δz|²``: the
    error attention sees is the plain squared error of the latents, which the water-filling and
    the Gaussian quantizer steps minimise. The encoder is ``L U`` and the decoder ``L⁻¹ U``.
    """
    n, s1, s2 = stats
    mean = s1 / n
    cov = s2 / n - np.einsum("hd,he->hde", mean, mean)
    decoder = None
    if metric is None:
        eigenvalues, vectors = _eigh(cov)
        basis = vectors
    else:
        dim = cov.shape[-1]
        seen = np.einsum("hde,hed->h", metric, cov)
        total = np.trace(cov, axis1=1, axis2=2)
        metric = metric * np.where(seen > 0, total / np.where(seen > 0, seen, 1.0), 1.0)[:, None, None]
        ridge = METRIC_RIDGE * np.trace(metric, axis1=1, axis2=2) / dim
        metric = metric + np.maximum(ridge, 1e-12)[:, None, None] * np.eye(dim)
        w, v = _eigh(metric)
        root = np.einsum("hij,hj,hkj->hik", v, np.sqrt(w), v)
        inverse_root = np.einsum("hij,hj,hkj->hik", v, 1.0 / np.sqrt(w), v)
        eigenvalues, vectors = _eigh(root @ cov @ root)
        basis, decoder = root @ vectors, inverse_root @ vectors
    order = np.argsort(-eigenvalues, axis=-1, kind="stable")
    variance = np.take_along_axis(np.maximum(eigenvalues, 0.0), order, axis=-1)
    basis = np.take_along_axis(basis, order[:, None, :], axis=-1)
    if decoder is not None:
        decoder = mx.array(np.take_along_axis(decoder, order[:, None, :], axis=-1).astype(np.float32))
    return TensorCalibration(
        basis=mx.array(basis.astype(np.float32)),
        mean=mx.array(mean.astype(np.float32)),
        variance=mx.array(variance.astype(np.float32)),
        decoder=decoder,
    )


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _model_dtype(model: Any) -> mx.Dtype | None:
    """The float dtype holding most of the model's parameter elements (None: no float parameters)."""
    sizes: dict[mx.Dtype, int] = {}
    for _, a in tree_flatten(model.parameters()):
        if mx.issubdtype(a.dtype, mx.floating):
            sizes[a.dtype] = sizes.get(a.dtype, 0) + a.size
    return max(sizes, key=sizes.get) if sizes else None


def _is_quantized(model: Any) -> bool:
    return any(a.dtype == mx.uint32 for _, a in tree_flatten(model.parameters()))


def _float32_is_faster(dtype: mx.Dtype, width: int) -> bool:
    """Whether a ``[256, width] x [width, width]`` matmul runs at least twice as fast in float32 as in ``dtype``.

    On mlx's CPU backend float32 matmuls go to the BLAS mlx is linked with (a reference BLAS in
    the Linux wheels, OpenBLAS when preloaded, Accelerate on macOS) while 16-bit ones use mlx's
    own kernels, so which is faster depends on the machine; the best of 3 timings decides.
    Twice as fast, not merely faster: float32 doubles the bytes every layer moves.
    """
    best = {}
    for dt in (mx.float32, dtype):
        x = mx.random.normal((256, width), key=mx.random.key(0)).astype(dt)
        w = mx.random.normal((width, width), key=mx.random.key(1)).astype(dt)
        mx.eval(x, w, x @ w)  # the first call pays one-time costs
        times = []
        for _ in range(3):
            t = time.perf_counter()
            mx.eval(x @ w)
            times.append(time.perf_counter() - t)
        best[dt] = min(times)
    return 2 * best[mx.float32] <= best[dtype]


def _compute_dtype(model: Any, requested: str) -> mx.Dtype | None:
    """The dtype the calibration's forward passes run in (None: the model's own, left as it is)."""
    current = _model_dtype(model)
    if requested == "model" or current is None or current == mx.float32:
        return None
    if requested == "float32":
        return mx.float32
    # "auto": quantized layers multiply in their own kernels, which the probe does not measure
    if _is_quantized(model):
        return None
    width = int(getattr(getattr(model, "args", None), "hidden_size", 0) or 1024)
    return mx.float32 if _float32_is_faster(current, width) else None


def _fit_layers(
    model: Any, stats: list[dict[str, list]], weighting: str, rotaries: list[Rotary] | None, progress: bool
) -> tuple[list[TensorCalibration | None], list[TensorCalibration | None]]:
    """Per layer, the key and value transforms from the recorded moments (None where not recorded)."""
    keys: list[TensorCalibration | None] = []
    values: list[TensorCalibration | None] = []
    for i, s in enumerate(tqdm(stats, desc="palu-mlx fit", unit="layer", disable=not progress)):
        if not s:
            keys.append(None)
            values.append(None)
        elif weighting == "none":
            keys.append(_fit(s["key"]))
            values.append(_fit(s["value"]))
        else:
            attn = model.layers[i].self_attn
            n_kv, dv = s["value"][1].shape
            key_metric = _query_metric(s["query"], n_kv, None if rotaries is None else rotaries[i])
            keys.append(_fit(s["key"], key_metric))
            values.append(_fit(s["value"], _output_metric(attn.o_proj, n_kv, dv)))
    return keys, values


def _spans(n_tokens: int, window: int, max_tokens: int | None) -> list[tuple[int, int]]:
    """The ``(start, stop)`` token windows a calibration runs: consecutive windows from the start,
    at most ``max_tokens`` tokens in all (the last window cut short where needed)."""
    stop_at = n_tokens if max_tokens is None else min(n_tokens, max_tokens)
    return [(start, min(start + window, stop_at)) for start in range(0, stop_at, window)]


def calibrate(
    model: Any,
    tokenizer: Any,
    text: str | None = None,
    window: int = 512,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    progress: bool = True,
    weighting: str = "attention",
    dtype: str = "auto",
) -> Calibration:
    """Fit a :class:`Calibration` for ``model`` on ``text`` (default: the shipped calibration text).

    The text's tokens are cut into windows of ``window`` tokens (capped at the model's
    positions), each run through the model from position 0 with fresh recording caches;
    ``max_tokens`` caps the tokens used (default :data:`DEFAULT_MAX_TOKENS`; None: all). Keys
    are recorded before RoPE when the architecture supports it (else after, with a
    :class:`~palu_mlx.rope.PreRopeFallbackWarning`). ``weighting`` is one of :data:`WEIGHTINGS`:
    ``"attention"`` also records the queries (by standing in for each layer's
    ``self_attn.rope`` while it runs, restored after) and weighs the channels by the queries
    (keys) and ``o_proj`` (values), see :func:`_fit`. ``dtype`` (one of :data:`COMPUTE_DTYPES`)
    is what the forward passes run in: ``"auto"`` casts a 16-bit model to float32 for the run when
    a float32 matmul measures at least twice as fast (mlx's CPU backend with a fast BLAS),
    ``"float32"`` always, ``"model"`` never; the model's own parameters are put back afterwards.
    """
    check_model(model)
    if not callable(getattr(tokenizer, "encode", None)):
        raise KVConfigError(f"tokenizer must have an encode(text) method; got {type(tokenizer).__name__}")
    if text is not None and not isinstance(text, str):
        raise KVConfigError(f"text must be None (the shipped text) or a str; got {type(text).__name__}")
    text = default_calibration_text() if text is None else text
    if not isinstance(window, int) or isinstance(window, bool) or window < 2:
        raise KVConfigError(f"window={window!r} must be an integer >= 2")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 2
    ):
        raise KVConfigError(f"max_tokens={max_tokens!r} must be None (all tokens) or an integer >= 2")
    if not isinstance(progress, bool):
        raise KVConfigError(f"progress={progress!r} must be True or False")
    if weighting not in WEIGHTINGS:
        raise KVConfigError(f"weighting={weighting!r} must be one of {', '.join(map(repr, WEIGHTINGS))}")
    if dtype not in COMPUTE_DTYPES:
        raise KVConfigError(f"dtype={dtype!r} must be one of {', '.join(map(repr, COMPUTE_DTYPES))}")
    head_dim, _ = model_kv_dims(model)
    rotaries = model_rotaries(model, head_dim)
    limit = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    if limit:
        window = min(window, int(limit))
    tokens = list(tokenizer.encode(text))
    if len(tokens) < 2:
        raise KVConfigError("the calibration text has fewer than 2 tokens")
    spans = _spans(len(tokens), window, max_tokens)
    used = sum(stop - start for start, stop in spans)
    defaults = default_caches(model)
    full = [type(c) is mlx_cache.KVCache for c in defaults]
    last = max((i for i, f in enumerate(full) if f), default=None)
    moments: list[dict[str, _Moments]] = [{} for _ in defaults]
    compute = _compute_dtype(model, dtype)
    # the very arrays the model holds, put back as they were (no round trip through float32)
    original = tree_flatten(model.parameters()) if compute is not None else None
    taps = _install_taps(model, full) if weighting == "attention" else [None] * len(defaults)
    try:
        if compute is not None:
            model.set_dtype(compute)
        bar = tqdm(total=used, desc="palu-mlx calibrate", unit="tok", disable=not progress)
        with bar:
            for start, stop in spans:
                recorded: list[dict[str, tuple]] = [{} for _ in defaults]
                caches = [
                    _Recorder(None if rotaries is None else rotaries[i], recorded[i], taps[i], i == last)
                    if full[i]
                    else c
                    for i, c in enumerate(default_caches(model))
                ]
                try:
                    mx.eval(model(mx.array(tokens[start:stop])[None], cache=caches))
                except _Recorded:  # the last recorded layer ends the pass: later layers, logits unneeded
                    pass
                # one evaluation per window: every layer's moments from one forward pass
                mx.eval([a for r in recorded for _, *arrays in r.values() for a in arrays])
                for i, r in enumerate(recorded):
                    for name, window_moments in r.items():
                        moments[i].setdefault(name, _Moments()).add(*window_moments)
                bar.update(stop - start)
    finally:
        _remove_taps(model, taps)
        if original is not None:
            model.update(tree_unflatten(original))
    stats = [{name: m.stats for name, m in layer.items()} for layer in moments]
    keys, values = _fit_layers(model, stats, weighting, rotaries, progress)
    return Calibration(
        model=model_identity(model),
        keys=keys,
        values=values,
        pre_rope=rotaries is not None,
        tokens=used,
        weighting=weighting,
        text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        compute_dtype=_dtype_name(compute if compute is not None else _model_dtype(model) or mx.float32),
    )
