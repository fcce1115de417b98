"""Group-head low-rank decomposition (PALU's G-LRD), fitted on the tokens at hand.

The ``H`` key (or value) heads of a layer are split into ``G`` contiguous
groups of ``H / G`` heads. Per group, the rows of every head, token and batch
item are stacked into one ``[N, D]`` matrix, mean-centred, and decomposed:
its right singular vectors ``V_g [D, D]`` (ordered by singular value) and
singular values give the shared projection and the rank decision.

The SVD is taken through the eigendecomposition of the ``D x D`` Gram matrix
``X_cᵀ X_c``: it has the same right singular vectors and ``σ² `` eigenvalues,
and avoids materialising the ``N x N`` left factor ``mx.linalg.svd`` returns.
All fitting and projection math runs in float32 (a projection may be stored
at 16 bits and is upcast when used).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError, KVDtypeError, KVShapeError, KVSpecError, KVValueError

from .int8_codes import int8_rows

__all__ = [
    "GroupProjection",
    "PackedProjection",
    "BASIS_BITS",
    "as_projection",
    "check_projection_arrays",
    "group_spectrum",
    "select_rank",
    "fit_group_projection",
    "project",
    "reconstruct",
]


def check_projection_arrays(
    owner: str,
    arrays: dict[str, Any],
    *,
    scale: str,
    heads: str,
    dtype_error: type[KVSpecError] = KVDtypeError,
    shape_error: type[KVSpecError] = KVShapeError,
) -> None:
    """Check the arrays of a projection: ``basis [X, D, r]``, ``mean [X, D]``, ``arrays[scale] [X, r]``
    and an optional ``decoder`` shaped like ``basis``, every one an mlx float array.

    Shapes only (no device sync), so a projection whose arrays disagree fails where it is built, not
    in a matmul. ``owner`` and ``heads`` (the name of ``X``) appear in the messages; a non-float array
    raises ``dtype_error``, a shape that does not fit ``shape_error``.
    """
    for name, arr in arrays.items():
        if not isinstance(arr, mx.array) or arr.dtype not in _FLOATS:
            got = arr.dtype if isinstance(arr, mx.array) else type(arr).__name__
            raise dtype_error(f"{owner}.{name} must be an mlx float array; got {got}")
    basis, mean, spread, decoder = arrays["basis"], arrays["mean"], arrays[scale], arrays.get("decoder")
    if basis.ndim != 3 or min(basis.shape) < 1:
        raise shape_error(
            f"{owner}.basis must be [{heads}, D, r] with every dim >= 1; got shape {basis.shape}"
        )
    g, d, r = basis.shape
    if tuple(mean.shape) != (g, d) or tuple(spread.shape) != (g, r):
        raise shape_error(
            f"{owner}: basis {basis.shape} needs mean [{g}, {d}] and {scale} [{g}, {r}]; "
            f"got {mean.shape} and {spread.shape}"
        )
    if decoder is not None and tuple(decoder.shape) != tuple(basis.shape):
        raise shape_error(f"{owner}: decoder must have the basis' shape {basis.shape}; got {decoder.shape}")


class _GroupBasisSizes:
    """``n_groups`` (G), ``dim`` (D) and ``rank`` (r) of a projection whose basis is held as a
    ``[G, D, r]`` array: the field ``_basis_field`` names (a packed basis is held as codes)."""

    _basis_field: ClassVar[str]

    @property
    def n_groups(self) -> int:
        return getattr(self, self._basis_field).shape[0]

    @property
    def dim(self) -> int:
        return getattr(self, self._basis_field).shape[1]

    @property
    def rank(self) -> int:
        return getattr(self, self._basis_field).shape[2]


@dataclass(frozen=True)
class GroupProjection(_GroupBasisSizes):
    """Shared per-group projections of one tensor (keys or values) of one layer.

    Attributes:
        basis: ``[G, D, r]`` float32, orthonormal columns ordered by singular value (or, with a
            ``decoder``, any encoder: latents are ``(x - μ) basis``).
        mean: ``[G, D]`` float32, the per-group mean subtracted before projecting.
        singular_values: ``[G, r]`` float32, descending, of the centred stacked rows.
        decoder: ``[G, D, r]`` or None: rebuild with ``latents decoderᵀ + μ``; None rebuilds with
            ``basis`` (exact for an orthonormal basis). A weighted calibration (see
            :mod:`palu_mlx.calibration`) fits a non-orthonormal encoder and its own decoder.
    """

    basis: mx.array
    mean: mx.array
    singular_values: mx.array
    decoder: mx.array | None = None
    _basis_field = "basis"

    def __post_init__(self) -> None:
        check_projection_arrays("GroupProjection", self.arrays(), scale="singular_values", heads="G")

    def astype(self, dtype: mx.Dtype) -> GroupProjection:
        """The same projection stored in ``dtype`` (math stays float32: arrays are upcast at use)."""
        if dtype not in _FLOATS:
            raise KVDtypeError(f"dtype={dtype!r} must be mlx float16, bfloat16 or float32")
        arrays = {k: v.astype(dtype) for k, v in self.arrays().items()}
        mx.eval(list(arrays.values()))
        # float16 holds magnitudes up to 65504: a larger mean would become infinity
        if dtype == mx.float16 and not all(mx.all(mx.isfinite(a)).item() for a in arrays.values()):
            raise KVValueError(
                "the projection (mean, basis or singular values) exceeds float16's range (65504); "
                "scale the inputs down or use bfloat16 inputs"
            )
        return GroupProjection(**arrays)

    def leading(self, rank: int) -> GroupProjection:
        """The first ``rank`` latent channels of this projection (contiguous copies; mean kept)."""
        return GroupProjection(
            basis=mx.contiguous(self.basis[:, :, :rank]),
            mean=self.mean,
            singular_values=mx.contiguous(self.singular_values[:, :rank]),
            decoder=None if self.decoder is None else mx.contiguous(self.decoder[:, :, :rank]),
        )

    @property
    def synthesis(self) -> mx.array:
        """``[G, D, r]``: what rebuilds the rows (the decoder, else the basis)."""
        return self.basis if self.decoder is None else self.decoder

    def arrays(self) -> dict[str, mx.array]:
        """``{"basis", "mean", "singular_values"}`` and ``"decoder"`` when set: every array held."""
        out = {"basis": self.basis, "mean": self.mean, "singular_values": self.singular_values}
        if self.decoder is not None:
            out["decoder"] = self.decoder
        return out


_FLOATS = (mx.float16, mx.bfloat16, mx.float32)

#: widths a basis can be held at: 16 (the projection's float dtype) or 8 (:class:`PackedProjection`)
BASIS_BITS: tuple[int, ...] = (16, 8)


@dataclass(frozen=True)
class PackedProjection(_GroupBasisSizes):
    """A :class:`GroupProjection` whose basis is held as int8 codes with one scale per column.

    A per-sequence basis of full rank is ``G x D x r`` 16-bit numbers per tensor and layer, whatever
    the bit budget of the codes: on a real model with 3 KV heads of 64 that is about a tenth of
    mlx-lm's 4-bit cache at 2,048 tokens. Symmetric 8-bit codes per column (a column is a unit
    vector, so its largest entry sets its scale) halve it; the basis they decode to is both the
    encoder and the decoder, so the only error is that basis' departure from orthonormality, about
    ``2^-8`` of a column relative, far below the latent codes' error at any bit budget. The
    singular values are not held: nothing reads them once the widths are chosen (the unpacked
    projection carries the column scales in their place, as a calibrated one carries its steps).

    Attributes:
        codes: ``[G, D, r]`` int8, the basis columns in units of their scale.
        column_scales: ``[G, r]`` float (the mean's dtype), each column's scale.
        mean: ``[G, D]`` float, as :attr:`GroupProjection.mean`.
    """

    codes: mx.array
    column_scales: mx.array
    mean: mx.array
    _basis_field = "codes"

    def __post_init__(self) -> None:
        codes = self.codes
        if (
            not isinstance(codes, mx.array)
            or codes.dtype != mx.int8
            or codes.ndim != 3
            or min(codes.shape) < 1
        ):
            got = (
                f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, mx.array) else type(codes).__name__
            )
            raise KVDtypeError(
                f"PackedProjection.codes must be an int8 [G, D, r] array (every dim >= 1); got {got}"
            )
        g, d, r = codes.shape
        for name, want in (("column_scales", (g, r)), ("mean", (g, d))):
            arr = getattr(self, name)
            if not isinstance(arr, mx.array) or arr.dtype not in _FLOATS:
                got = arr.dtype if isinstance(arr, mx.array) else type(arr).__name__
                raise KVDtypeError(f"PackedProjection.{name} must be an mlx float array; got {got}")
            if tuple(arr.shape) != want:
                raise KVShapeError(
                    f"PackedProjection: codes {tuple(codes.shape)} need {name} {list(want)}; got {tuple(arr.shape)}"
                )

    @classmethod
    def pack(cls, projection: GroupProjection) -> PackedProjection:
        """``projection``'s basis as int8 codes per column (its mean kept as it is, scales in the mean's
        dtype). A projection with a separate decoder cannot be packed."""
        _check_projection(projection)
        if projection.decoder is not None:
            raise KVConfigError("a projection with a separate decoder cannot be packed to an 8-bit basis")
        # a column is a row of the transposed basis
        codes, scales = int8_rows(projection.basis.swapaxes(1, 2), projection.mean.dtype)
        codes, scales = mx.contiguous(codes.swapaxes(1, 2)), scales[..., 0]
        mx.eval(codes, scales)
        return cls(codes, scales, projection.mean)

    def unpacked(self) -> GroupProjection:
        """The :class:`GroupProjection` these codes stand for (float32 basis; built at each use, not held)."""
        basis = self.codes.astype(mx.float32) * self.column_scales.astype(mx.float32)[:, None, :]
        return GroupProjection(basis=basis, mean=self.mean, singular_values=self.column_scales)

    #: no separate decoder: the unpacked basis rebuilds
    decoder = None

    def arrays(self) -> dict[str, mx.array]:
        """``{"basis", "basis_scale", "mean"}``: every array held (``basis`` int8)."""
        return {"basis": self.codes, "basis_scale": self.column_scales, "mean": self.mean}


def as_projection(projection: GroupProjection | PackedProjection) -> GroupProjection:
    """``projection`` as a :class:`GroupProjection` (a packed one unpacked); KVConfigError otherwise."""
    if isinstance(projection, PackedProjection):
        return projection.unpacked()
    _check_projection(projection)
    return projection


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_x(x, name: str = "x") -> None:
    if not isinstance(x, mx.array) or x.dtype not in _FLOATS:
        got = x.dtype if isinstance(x, mx.array) else type(x).__name__
        raise KVDtypeError(f"{name} must be an mlx float16, bfloat16 or float32 array; got {got}")
    if x.ndim != 4 or min(x.shape) < 1:
        raise KVShapeError(f"{name} must be [B, H, S, D] with every dim >= 1; got shape {x.shape}")


def _check_projection(projection) -> None:
    if not isinstance(projection, GroupProjection):
        raise KVConfigError(f"projection must be a GroupProjection; got {type(projection).__name__}")


def _check_groups(n_heads: int, n_groups: int) -> int:
    if not _is_int(n_groups) or n_groups < 1:
        raise KVConfigError(f"palu_n_head_groups={n_groups!r} must be a positive integer")
    if n_heads % n_groups != 0:
        raise KVConfigError(
            f"palu_n_head_groups={n_groups} must divide the layer's key/value head count {n_heads}; "
            f"allowed: a divisor of {n_heads}"
        )
    return n_heads // n_groups


def _grouped_rows(x: mx.array, n_groups: int) -> mx.array:
    """``[B, H, S, D]`` -> ``[G, B * (H/G) * S, D]`` float32: each group's rows stacked."""
    b, h, s, d = x.shape
    per_group = _check_groups(h, n_groups)
    x = x.astype(mx.float32).reshape(b, n_groups, per_group, s, d)
    return x.transpose(1, 0, 2, 3, 4).reshape(n_groups, b * per_group * s, d)


#: float32's largest finite value: the fit's second moments are float32 sums of products of rows
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _check_fit_magnitude(rows: mx.array) -> None:
    """``KVValueError`` when ``rows [G, N, D]`` are too large for float32 fit statistics.

    The Gram matrix sums ``N`` products of centred entries (up to twice the largest magnitude), so
    past ``sqrt(float32 max / (4 N D))`` its entries or its norm overflow and the eigensolver fails
    or returns NaN; a further factor of 16 leaves the solver its headroom. Checked before any fit
    so the cache is left as it was.
    """
    _, n, d = rows.shape
    limit = (_FLOAT32_MAX / (64.0 * n * d)) ** 0.5
    peak = mx.max(mx.abs(rows)).item()
    if peak > limit:  # NaN compares False: non-finite input is reported by the finiteness checks
        raise KVValueError(
            f"keys/values magnitude {peak:.3g} is too large for the fit's float32 statistics over {n} rows "
            f"of dim {d}: allowed max |x| <= {limit:.3g}; scale the inputs down"
        )


def group_spectrum(x: mx.array, n_groups: int) -> tuple[mx.array, mx.array, mx.array]:
    """Full spectrum of each head group of ``x [B, H, S, D]``.

    Returns ``(vectors [G, D, D], singular_values [G, D], mean [G, D])``, all
    float32, columns of ``vectors`` ordered by descending singular value.
    """
    _check_x(x)
    rows = _grouped_rows(x, n_groups)
    _check_fit_magnitude(rows)
    mean = mx.mean(rows, axis=1)
    centred = rows - mean[:, None, :]
    gram = centred.transpose(0, 2, 1) @ centred
    # eigh is CPU-only in MLX; ascending order, flipped to descending below.
    eigenvalues, vectors = mx.linalg.eigh(gram, stream=mx.cpu)
    eigenvalues = eigenvalues[:, ::-1]
    vectors = vectors[:, :, ::-1]
    singular_values = mx.sqrt(mx.maximum(eigenvalues, 0.0))
    return vectors, singular_values, mean


def numeric_array(value: Any, dtype: type[np.generic], refusal: KVSpecError) -> np.ndarray:
    """``value`` as a numpy array of ``dtype``; raises ``refusal`` (naming the argument) when it is
    not numeric."""
    try:
        return np.asarray(value, dtype=dtype)
    except (TypeError, ValueError):
        raise refusal from None


def select_rank(singular_values: mx.array | np.ndarray, energy_threshold: float) -> int:
    """Smallest rank keeping ``energy_threshold`` of ``σ²`` energy, minimised over groups.

    ``singular_values`` is ``[G, D]`` (descending per row). A group with zero
    energy (constant data) needs rank 1. Returns an int in ``[1, D]``.
    """
    if not isinstance(energy_threshold, (int, float)) or isinstance(energy_threshold, bool):
        raise KVConfigError(f"energy_threshold={energy_threshold!r} must be a number in (0, 1]")
    if not 0.0 < energy_threshold <= 1.0:
        raise KVConfigError(f"energy_threshold={energy_threshold!r} must be a number in (0, 1]")
    sv = numeric_array(
        singular_values,
        np.float64,
        KVConfigError(
            f"singular_values must be a numeric [G, D] array; got {type(singular_values).__name__}"
        ),
    )
    if sv.ndim != 2 or sv.size == 0:
        raise KVShapeError(f"singular_values must be [G, D] with G, D >= 1; got shape {sv.shape}")
    if not np.all(np.isfinite(sv)):
        raise KVValueError("singular_values contain NaN or infinity")
    energy = sv**2
    total = energy.sum(axis=1, keepdims=True)
    cumulative = np.cumsum(energy, axis=1) / np.where(total > 0, total, 1.0)
    # 1e-6 slack so an exact-rank signal with float32 noise in the tail is not pushed to D.
    reached = cumulative >= energy_threshold - 1e-6
    ranks = np.where(total[:, 0] > 0, reached.argmax(axis=1) + 1, 1)
    return int(max(1, min(ranks.min(), sv.shape[1])))


def fit_group_projection(
    x: mx.array,
    n_groups: int,
    rank: int | None = None,
    energy_threshold: float = 0.90,
) -> GroupProjection:
    """Fit shared group projections to ``x [B, H, S, D]`` (any float dtype).

    ``rank`` fixes ``r``; None selects it with :func:`select_rank`. One ``r`` is
    used for every group so the latent buffers share one shape.
    """
    _check_x(x)
    if rank is not None and not _is_int(rank):
        raise KVConfigError(f"palu_rank={rank!r} must be None or an integer in [1, {x.shape[-1]}]")
    if rank is not None and not 1 <= rank <= x.shape[-1]:
        raise KVConfigError(
            f"palu_rank={rank} must be in [1, {x.shape[-1]}] (the head dimension of this tensor)"
        )
    vectors, singular_values, mean = group_spectrum(x, n_groups)
    d = x.shape[-1]
    if rank is None:
        rank = select_rank(np.array(singular_values), energy_threshold)
    if not 1 <= rank <= d:
        raise KVConfigError(f"palu_rank={rank} must be in [1, {d}] (the head dimension of this tensor)")
    basis = mx.contiguous(vectors[:, :, :rank])
    sv = mx.contiguous(singular_values[:, :rank])
    mx.eval(basis, mean, sv)
    return GroupProjection(basis=basis, mean=mean, singular_values=sv)


def project(x: mx.array, projection: GroupProjection) -> mx.array:
    """Latents ``L = (x - μ_g) V_g``: ``[B, H, S, D]`` -> ``[B, H, S, r]`` float32 (``projection``
    may be a :class:`PackedProjection`)."""
    projection = as_projection(projection)
    _check_x(x)
    if x.shape[-1] != projection.dim:
        raise KVShapeError(f"x has head dim {x.shape[-1]}; the projection's is {projection.dim}")
    b, h, s, d = x.shape
    g = projection.n_groups
    per_group = _check_groups(h, g)
    x = x.astype(mx.float32).reshape(b, g, per_group, s, d)
    centred = x - projection.mean.astype(mx.float32)[None, :, None, None, :]
    latents = centred @ projection.basis.astype(mx.float32)[None, :, None, :, :]
    return latents.reshape(b, h, s, projection.rank)


def reconstruct(latents: mx.array, projection: GroupProjection, dtype: mx.Dtype) -> mx.array:
    """``L V_gᵀ + μ_g`` (``V_g``: the decoder when the projection has one): ``[B, H, S, r]`` float32 ->
    ``[B, H, S, D]`` in ``dtype`` (``projection`` may be a :class:`PackedProjection`)."""
    projection = as_projection(projection)
    if not isinstance(latents, mx.array) or latents.ndim != 4 or latents.shape[-1] != projection.rank:
        got = latents.shape if isinstance(latents, mx.array) else type(latents).__name__
        raise KVShapeError(f"latents must be an mlx array [B, H, S, r={projection.rank}]; got {got}")
    if dtype not in _FLOATS:
        raise KVDtypeError(f"dtype={dtype!r} must be mlx float16, bfloat16 or float32")
    b, h, s, r = latents.shape
    g = projection.n_groups
    per_group = _check_groups(h, g)
    # one batched [G, rows, r] @ [G, r, D] product: about twice as fast on CPU as broadcasting
    # the basis over a 5-D latent array (the transposes are free when B = 1)
    rows = latents.astype(mx.float32).reshape(b, g, per_group * s, r).transpose(1, 0, 2, 3)
    rows = rows.reshape(g, b * per_group * s, r)
    basis_t = mx.contiguous(projection.synthesis.astype(mx.float32).transpose(0, 2, 1))
    full = rows @ basis_t + projection.mean.astype(mx.float32)[:, None, :]
    full = full.reshape(g, b, per_group * s, projection.dim).transpose(1, 0, 2, 3)
    return full.reshape(b, h, s, projection.dim).astype(dtype)
