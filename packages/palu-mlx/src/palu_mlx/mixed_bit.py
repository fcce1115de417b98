"""Mixed-bit coder for latent channels, with a pluggable bit-allocation policy.

Latent channels arrive ordered by singular value (channel 0 carries the most
energy). A :class:`BitAllocationPolicy` cuts them into contiguous
:class:`Segment`\\ s, each with one bit width: :class:`FixedSplitPolicy` gives the top
``hi_fraction`` of channels ``hi_bit`` and the rest ``lo_bit`` (the reference's split),
:class:`WaterFillingPolicy` spreads a bit budget by reverse water-filling over the singular
values (:func:`water_fill`), :class:`UniformPolicy` gives every channel one width. Which coder a
config uses is :mod:`palu_mlx.coders`' business; :class:`MixedBitCoder` is the one these
segments drive.

Storage of a segment of ``n`` channels at ``b`` bits, per token and head:

* groups of ``group_size`` consecutive channels share one affine scale and
  bias (``x ≈ q * scale + bias``, ``q`` in ``[0, 2^b - 1]``), stored at 16 bits
  (``scale_dtype``: float16, or bfloat16 for bfloat16 models). A float16 scale or bias
  cannot hold a magnitude above 65504, so :meth:`MixedBitCoder.encode` refuses latents
  whose scales, biases or unquantized values would not fit (``KVValueError``) instead of
  storing infinity. When ``n`` is not a multiple of
  ``group_size`` the last group is smaller: its min/max are taken over its own
  channels only (the padding replicates its last channel and is never stored).
* codes are really packed: ``8 // b`` per ``uint8`` for b in {1, 2, 4, 8} and
  ``32 // b`` per ``uint32`` for b in {3, 5, 6} (2 bits of each word unused);
  the last word of a row is zero-padded.
* ``b = 16`` stores the channels unquantized in the input dtype.

Quantization works along the channel axis of each token independently, so a
token's codes never change when later tokens arrive.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError, KVValueError

__all__ = [
    "Segment",
    "BitAllocationPolicy",
    "FixedSplitPolicy",
    "UniformPolicy",
    "WaterFillingPolicy",
    "water_fill",
    "CODER_BITS",
    "PACKABLE_BITS",
    "UNQUANTIZED_BITS",
    "MixedBitCoder",
    "pack_codes",
    "unpack_codes",
    "validate_segments",
    "check_storable",
    "check_policy",
]

_FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
#: largest finite float16; what a float16 scale, bias or stored latent can hold
FLOAT16_MAX = 65504.0


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


#: Bit widths the mixed-bit coder packs that ``mx.quantize`` also accepts (a config's hi/lo widths).
PACKABLE_BITS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)
#: A "bit width" of 16 means: store those latent channels unquantized, in the input dtype.
UNQUANTIZED_BITS = 16
#: widths a coder segment can have: 1..8 bits packed (7 as 4 codes per uint32), 16 = unquantized.
#: A policy may also return 0 bits for trailing channels: the cache drops them (they decode to the mean).
CODER_BITS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, UNQUANTIZED_BITS)


@dataclass(frozen=True)
class Segment:
    """Latent channels ``[start, stop)`` coded at ``bits`` (16 = unquantized)."""

    start: int
    stop: int
    bits: int

    def __post_init__(self) -> None:
        # width 0 is allowed here (policies build empty segments and drop them); coders refuse it
        if not all(_is_int(v) for v in (self.start, self.stop, self.bits)):
            raise KVConfigError(
                f"Segment{(self.start, self.stop, self.bits)!r}: start, stop and bits must be ints"
            )
        if self.start < 0 or self.stop < self.start or self.bits < 0:
            raise KVConfigError(
                f"Segment(start={self.start}, stop={self.stop}, bits={self.bits}): needs 0 <= start <= stop "
                "and bits >= 0"
            )
        # numpy ints become Python ints: segments are written into meta_state as JSON
        for name in ("start", "stop", "bits"):
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def width(self) -> int:
        return self.stop - self.start


@runtime_checkable
class BitAllocationPolicy(Protocol):
    """Decides the bit width of every latent channel of one tensor."""

    def allocate(self, singular_values: np.ndarray) -> tuple[Segment, ...]:
        """``singular_values [G, r]`` (descending per group) -> segments covering ``[0, r)``."""
        ...


def _singular_values(singular_values) -> np.ndarray:
    """A policy's input as float64 ``[..., r]`` (1-D or 2-D, r >= 1, finite); KVConfigError otherwise."""
    try:
        sv = np.asarray(singular_values, dtype=np.float64)
    except (TypeError, ValueError):
        raise KVConfigError(
            f"singular_values must be a numeric array [G, r] or [r]; got {type(singular_values).__name__}"
        ) from None
    if sv.ndim not in (1, 2) or sv.shape[-1] < 1 or sv.size == 0:
        raise KVConfigError(f"singular_values must be [G, r] or [r] with r >= 1; got shape {sv.shape}")
    if not np.all(np.isfinite(sv)):
        raise KVConfigError("singular_values contain NaN or infinity")
    return sv


def check_policy(allocation_policy: object) -> None:
    """Raise ``KVConfigError`` unless ``allocation_policy`` is None or a :class:`BitAllocationPolicy`."""
    if allocation_policy is not None and not isinstance(allocation_policy, BitAllocationPolicy):
        raise KVConfigError(
            f"allocation_policy must be a BitAllocationPolicy (with .allocate) or None; "
            f"got {type(allocation_policy).__name__}"
        )


def _check_coder_width(name: str, bits: Any, may_drop: bool = False) -> None:
    """Raise ``KVConfigError`` unless ``bits`` is one of :data:`CODER_BITS` (or 0, dropping the
    channels, where ``may_drop``)."""
    allowed = (0, *CODER_BITS) if may_drop else CODER_BITS
    if not _is_int(bits) or bits not in allowed:
        shown = f"0 (drop), {CODER_BITS}" if may_drop else f"{CODER_BITS}"
        raise KVConfigError(f"{name}={bits!r} is not a coder width; allowed: {shown}")


def _merge(segments: list[Segment]) -> tuple[Segment, ...]:
    merged: list[Segment] = []
    for seg in segments:
        if seg.width <= 0:
            continue
        if merged and merged[-1].bits == seg.bits and merged[-1].stop == seg.start:
            merged[-1] = Segment(merged[-1].start, seg.stop, seg.bits)
        else:
            merged.append(seg)
    return tuple(merged)


@dataclass(frozen=True)
class FixedSplitPolicy:
    """The seed policy: ``ceil(hi_fraction * r)`` top channels at ``hi_bit``, the rest at ``lo_bit``."""

    hi_bit: int
    lo_bit: int
    hi_fraction: float

    def __post_init__(self) -> None:
        _check_coder_width("hi_bit", self.hi_bit)
        _check_coder_width("lo_bit", self.lo_bit, may_drop=True)
        f = self.hi_fraction
        if not _is_real(f) or not math.isfinite(f) or not 0.0 <= f <= 1.0:
            raise KVConfigError(f"hi_fraction={f!r} must be a number in [0, 1]")

    def allocate(self, singular_values: np.ndarray) -> tuple[Segment, ...]:
        rank = int(_singular_values(singular_values).shape[-1])
        # The small epsilon keeps 0.25 * 16 = 4 from becoming 5 through float error.
        n_hi = min(rank, math.ceil(self.hi_fraction * rank - 1e-9))
        return _merge([Segment(0, n_hi, self.hi_bit), Segment(n_hi, rank, self.lo_bit)])


@dataclass(frozen=True)
class UniformPolicy:
    """Every channel at one bit width (16 keeps the latents unquantized)."""

    bits: int

    def __post_init__(self) -> None:
        _check_coder_width("bits", self.bits)

    def allocate(self, singular_values: np.ndarray) -> tuple[Segment, ...]:
        return _merge([Segment(0, int(_singular_values(singular_values).shape[-1]), self.bits)])


def water_fill(variances: Sequence[np.ndarray], budget_bits: int, max_bits: int = 8) -> list[np.ndarray]:
    """Integer reverse water-filling: spread ``budget_bits`` over every channel of every tensor.

    ``variances`` is one 1-D array of channel variances per tensor (any number of layers,
    keys and values together: one level for all). Under the high-rate model a channel of
    variance ``λ`` coded at ``b`` bits keeps an error ``λ 4^-b``, so each next bit is given to
    the channel whose error it cuts most (``0.75 λ 4^-b``); that greedy choice is the optimal
    integer allocation for this convex model, and it is reverse water-filling with integer
    widths: channels below the level get 0 bits (dropped).

    Returns one int array of widths in ``[0, max_bits]`` per tensor. Exactly ``budget_bits``
    are spent unless every channel of positive variance already has ``max_bits``; a
    zero-variance channel never gets a bit. Ties go to the earlier tensor and channel, so for
    variances sorted in descending order the widths are non-increasing.
    """
    if not _is_int(budget_bits) or budget_bits < 0:
        raise KVConfigError(f"budget_bits={budget_bits!r} must be a non-negative integer")
    if not _is_int(max_bits) or not 1 <= max_bits <= 8:
        raise KVConfigError(f"max_bits={max_bits!r} must be an integer in [1, 8]")
    if isinstance(variances, (str, bytes, np.ndarray)) or not isinstance(variances, Sequence):
        raise KVConfigError(
            f"variances must be a sequence of 1-D arrays (one per tensor); got {type(variances).__name__}"
        )
    lams = []
    for i, v in enumerate(variances):
        try:
            lam = np.asarray(v, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise KVConfigError(f"variances[{i}] must be a numeric array; got {type(v).__name__}") from None
        if not np.all(np.isfinite(lam)):
            raise KVConfigError(f"variances[{i}] contains NaN or infinity")
        lams.append(np.maximum(lam, 0.0))
    widths = [np.zeros(lam.shape, dtype=np.int64) for lam in lams]
    # max-heap on the error the next bit removes; (tensor, channel) breaks ties deterministically
    heap = [(-0.75 * lam[c], t, c) for t, lam in enumerate(lams) for c in range(lam.size) if lam[c] > 0]
    heapq.heapify(heap)
    for _ in range(int(budget_bits)):
        if not heap:
            break
        _, t, c = heapq.heappop(heap)
        widths[t][c] += 1
        if widths[t][c] < max_bits:
            heapq.heappush(heap, (-0.75 * lams[t][c] * 4.0 ** -int(widths[t][c]), t, c))
    return widths


def segments_from_widths(widths: np.ndarray) -> tuple[Segment, ...]:
    """Per-channel widths ``[r]`` -> contiguous :class:`Segment`\\ s (runs of one width; 0 kept)."""
    widths = np.asarray(widths).reshape(-1)
    if widths.dtype.kind not in "iu":
        raise KVConfigError(f"widths must be integers; got dtype {widths.dtype}")
    return _merge([Segment(i, i + 1, int(w)) for i, w in enumerate(widths)])


@dataclass(frozen=True)
class WaterFillingPolicy:
    """Bits per latent channel by reverse water-filling on the channel variances (one tensor).

    ``bits`` is the target average code bits per *original* element: a tensor of ``r``
    channels (fitted at full rank, ``r = D``) gets ``round(bits * r)`` code bits per token and
    head, shared by :func:`water_fill` over the channel variances (``σ²`` averaged over the
    head groups, which share one segment layout). Channels below the level get 0 bits: the
    cache drops them, so the rank follows from the budget. Scales and biases of the coder
    (16 bits per group of ``palu_group_size`` channels per token) come on top of the budget.
    """

    bits: float
    max_bits: int = 8

    #: the cache fits this policy's tensors at full rank and lets it choose the rank
    chooses_rank = True

    def __post_init__(self) -> None:
        if not _is_real(self.bits) or not math.isfinite(self.bits) or not 0 < self.bits <= 8:
            raise KVConfigError(f"palu_bits={self.bits!r} must be a number in (0, 8]")
        if not _is_int(self.max_bits) or not 1 <= self.max_bits <= 8:
            raise KVConfigError(f"max_bits={self.max_bits!r} must be an integer in [1, 8]")

    def allocate(self, singular_values: np.ndarray) -> tuple[Segment, ...]:
        sv = np.atleast_2d(_singular_values(singular_values))
        variances = (sv**2).mean(axis=0)
        budget = int(round(self.bits * sv.shape[-1]))
        return segments_from_widths(water_fill([variances], budget, self.max_bits)[0])


# --------------------------------------------------------------------------- packing
def _word(bits: int) -> tuple[mx.Dtype, int]:
    """Storage word and codes per word for ``bits``."""
    if 8 % bits == 0:
        return mx.uint8, 8 // bits
    return mx.uint32, 32 // bits


def _check_pack_bits(bits) -> None:
    if not _is_int(bits) or not 1 <= bits <= 8:
        raise KVConfigError(f"bits={bits!r} cannot be packed; allowed: an int in [1, 8]")


def _pack(codes: mx.array, bits: int) -> mx.array:
    # the coder's own codes are clipped to [0, 2**bits - 1], so it skips pack_codes' checks
    dtype, per_word = _word(bits)
    n = codes.shape[-1]
    n_words = -(-n // per_word)
    pad = n_words * per_word - n
    codes = codes.astype(dtype)
    if pad:
        codes = mx.concatenate([codes, mx.zeros((*codes.shape[:-1], pad), dtype=dtype)], axis=-1)
    codes = codes.reshape(*codes.shape[:-1], n_words, per_word)
    shifts = (mx.arange(per_word) * bits).astype(dtype)
    # Fields are disjoint, so the sum equals the bitwise OR and cannot carry.
    return mx.sum(codes << shifts, axis=-1).astype(dtype)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes ``[..., n]`` (each in ``[0, 2**bits)``) into words ``[..., ceil(n / per_word)]``.

    A code outside that range would spill into its neighbour's field, so it raises
    ``KVValueError`` instead (this check syncs the device once).
    """
    _check_pack_bits(bits)
    if not isinstance(codes, mx.array):
        raise KVDtypeError(f"codes must be an mlx.core.array of integers; got {type(codes).__name__}")
    if codes.ndim < 1 or not mx.issubdtype(codes.dtype, mx.integer):
        raise KVDtypeError(
            f"codes must be an integer array with at least one axis; got {codes.dtype}, shape {codes.shape}"
        )
    if codes.size:
        lo, hi = mx.min(codes).item(), mx.max(codes).item()
        if lo < 0 or hi >= 1 << bits:
            raise KVValueError(
                f"codes span [{lo}, {hi}] but {bits}-bit codes must lie in [0, {(1 << bits) - 1}] "
                "(a wider code would overwrite its neighbour)"
            )
    return _pack(codes, bits)


def unpack_codes(words: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of :func:`pack_codes`: words ``[..., W]`` -> codes ``[..., n]`` (same word dtype)."""
    _check_pack_bits(bits)
    dtype, per_word = _word(bits)
    if not isinstance(words, mx.array) or words.ndim < 1 or words.dtype != dtype:
        got = f"{words.dtype}, shape {words.shape}" if isinstance(words, mx.array) else type(words).__name__
        raise KVDtypeError(
            f"words of {bits}-bit codes must be an mlx {dtype} array with at least one axis; got {got}"
        )
    if not _is_int(n) or not 0 <= n <= words.shape[-1] * per_word:
        raise KVShapeError(
            f"n={n!r} must be an int in [0, {words.shape[-1] * per_word}] (codes the words hold)"
        )
    return _unpack(words, bits, int(n))


def _unpack(words: mx.array, bits: int, n: int) -> mx.array:
    dtype, per_word = _word(bits)
    shifts = (mx.arange(per_word) * bits).astype(dtype)
    mask = mx.array((1 << bits) - 1, dtype=dtype)
    codes = (words[..., None] >> shifts) & mask
    return codes.reshape(*words.shape[:-1], words.shape[-1] * per_word)[..., :n]


# --------------------------------------------------------------------------- range
def check_storable(arrays: list[mx.array], what: str) -> None:
    """Raise ``KVValueError`` unless every array (already cast to its storage dtype) is finite.

    The coder casts scales, biases and unquantized latents to their 16-bit storage dtype;
    a float16 cast turns magnitudes above 65504 into infinity, and non-finite latents (an
    overflow upstream) stay so. Checking the cast values catches both, exactly: one device sync.
    """
    if not arrays:
        return
    ok = mx.all(mx.stack([mx.all(mx.isfinite(a)) for a in arrays]))
    if not ok.item():
        raise KVValueError(
            f"{what}: the latents do not fit the coder's storage (float16 scales, biases or latents hold "
            f"magnitudes up to {FLOAT16_MAX:g}; or the latents are not finite); the cache is unchanged. "
            "Scale the inputs down, or use bfloat16 inputs (bfloat16 scales have float32's range)"
        )


# --------------------------------------------------------------------------- coder
def validate_segments(segments) -> None:
    """Raise ``KVConfigError`` unless ``segments`` is a non-empty tuple/list of :class:`Segment`
    contiguous from channel 0, each of width >= 1 and bits in :data:`CODER_BITS`."""
    if not isinstance(segments, (tuple, list)) or not segments:
        raise KVConfigError(f"segments={segments!r} must be a non-empty tuple of Segment")
    for seg in segments:
        if not isinstance(seg, Segment):
            raise KVConfigError(f"segments must hold Segment objects; got {type(seg).__name__}")
    if segments[0].start != 0:
        raise KVConfigError(f"segments={tuple(segments)!r} must start at channel 0")
    for prev, seg in zip(segments[:-1], segments[1:], strict=True):
        if seg.start != prev.stop:
            raise KVConfigError(f"segments={tuple(segments)!r} must be contiguous")
    for seg in segments:
        if seg.width < 1 or seg.bits not in CODER_BITS:
            raise KVConfigError(f"segment {seg!r}: width must be >= 1 and bits one of {CODER_BITS}")


class MixedBitCoder:
    """Codes latents ``[..., r]`` float32 into packed per-segment arrays and back.

    Args:
        segments: contiguous segments covering ``[0, r)``.
        group_size: channels per scale/bias group (positive int).
        store_dtype: dtype of unquantized (16-"bit") channels: the input dtype.
        scale_dtype: dtype of scales and biases (default ``store_dtype``).
    """

    def __init__(
        self,
        segments: tuple[Segment, ...],
        group_size: int,
        store_dtype: mx.Dtype,
        scale_dtype: mx.Dtype | None = None,
    ):
        validate_segments(segments)
        if not _is_int(group_size) or group_size < 1:
            raise KVConfigError(f"group_size={group_size!r} must be a positive integer")
        for name, dtype in (("store_dtype", store_dtype), ("scale_dtype", scale_dtype)):
            if not (dtype is None and name == "scale_dtype") and dtype not in _FLOAT_DTYPES:
                raise KVDtypeError(f"{name}={dtype!r} must be mlx float16, bfloat16 or float32")
        self.segments = tuple(segments)
        self.group_size = int(group_size)
        self.store_dtype = store_dtype
        self.scale_dtype = scale_dtype or store_dtype

    # mx.Dtype does not pickle: store the names (caches are copied and pickled by mlx-lm's server)
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in ("store_dtype", "scale_dtype"):
            state[name] = str(state[name]).split(".")[-1]
        return state

    def __setstate__(self, state: dict) -> None:
        for name in ("store_dtype", "scale_dtype"):
            state[name] = getattr(mx, state[name])
        self.__dict__.update(state)

    @property
    def rank(self) -> int:
        return self.segments[-1].stop

    @property
    def quantizes(self) -> bool:
        """Whether any channel is quantized (else every latent is stored as is)."""
        return any(s.bits != UNQUANTIZED_BITS for s in self.segments)

    @property
    def assigned_avg_bits(self) -> float:
        """Mean bits assigned per latent channel (code bits only, no scale overhead)."""
        return sum(s.width * s.bits for s in self.segments) / self.rank

    def _n_groups(self, seg: Segment) -> int:
        return -(-seg.width // self.group_size)

    def field_widths(self) -> dict[str, tuple[int, mx.Dtype]]:
        """Name -> (last-axis width, dtype) of every array one coded token row holds."""
        out: dict[str, tuple[int, mx.Dtype]] = {}
        for i, seg in enumerate(self.segments):
            if seg.bits == UNQUANTIZED_BITS:
                out[f"seg{i}.values"] = (seg.width, self.store_dtype)
                continue
            dtype, per_word = _word(seg.bits)
            out[f"seg{i}.codes"] = (-(-seg.width // per_word), dtype)
            out[f"seg{i}.scales"] = (self._n_groups(seg), self.scale_dtype)
            out[f"seg{i}.biases"] = (self._n_groups(seg), self.scale_dtype)
        return out

    def encode(self, latents: mx.array) -> dict[str, mx.array]:
        """Latents ``[..., r]`` (float) -> ``{field: array [..., width]}``.

        Raises ``KVValueError`` (before returning anything) when a float16 scale, bias or
        unquantized latent would overflow, or the latents are not finite.
        """
        if not isinstance(latents, mx.array) or latents.ndim < 1:
            raise KVDtypeError(f"latents must be an mlx.core.array [..., r]; got {type(latents).__name__}")
        if latents.dtype not in _FLOAT_DTYPES:
            raise KVDtypeError(f"latents dtype {latents.dtype} is not float16, bfloat16 or float32")
        if latents.shape[-1] != self.rank:
            raise KVShapeError(f"latents have {latents.shape[-1]} channels; coder rank is {self.rank}")
        latents = latents.astype(mx.float32)
        out: dict[str, mx.array] = {}
        stored: list[mx.array] = []  # what was cast to a narrower dtype: checked before returning
        for i, seg in enumerate(self.segments):
            x = latents[..., seg.start : seg.stop]
            if seg.bits == UNQUANTIZED_BITS:
                out[f"seg{i}.values"] = x.astype(self.store_dtype)
                stored.append(out[f"seg{i}.values"])
                continue
            codes, scales, biases = self._quantize(x, seg.bits)
            out[f"seg{i}.codes"] = _pack(codes, seg.bits)
            out[f"seg{i}.scales"] = scales
            out[f"seg{i}.biases"] = biases
            stored += [scales, biases]
        # Only float16 storage can overflow from finite float32 latents: other coders skip the sync.
        if any(a.dtype == mx.float16 for a in stored):
            check_storable(stored, "MixedBitCoder.encode")
        return out

    def decode(self, coded: dict[str, mx.array]) -> mx.array:
        """``{field: array [..., width]}`` -> latents ``[..., r]`` float32."""
        widths = self.field_widths()
        if not isinstance(coded, Mapping) or set(coded) != set(widths):
            got = sorted(coded) if isinstance(coded, Mapping) else type(coded).__name__
            raise KVDataError(f"coded must hold exactly the fields {sorted(widths)}; got {got}")
        for name, (width, dtype) in widths.items():
            arr = coded[name]
            if not isinstance(arr, mx.array) or arr.dtype != dtype or arr.ndim < 1 or arr.shape[-1] != width:
                raise KVDataError(
                    f"coded field {name!r} must be {dtype} [..., {width}]; got {_describe(arr)}"
                )
        parts = []
        for i, seg in enumerate(self.segments):
            if seg.bits == UNQUANTIZED_BITS:
                parts.append(coded[f"seg{i}.values"].astype(mx.float32))
                continue
            codes = _unpack(coded[f"seg{i}.codes"], seg.bits, seg.width).astype(mx.float32)
            parts.append(self._dequantize(codes, coded[f"seg{i}.scales"], coded[f"seg{i}.biases"], seg.width))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    # -- the latent-coder interface the caches use (palu_mlx.coders.base.LatentCoder)
    #: the fields of one token row (per-group scales and biases travel with the codes)
    encode_fields = encode
    decode_fields = decode
    #: only fixed-quantizer coders have one width per channel and no per-group scales
    fixed_widths = None

    def constants(self) -> dict[str, mx.array]:
        """Arrays held once beside the codes: none (scales and biases are per token)."""
        return {}

    # -- affine group quantization along the channel axis
    def _grouped(self, x: mx.array, fill_edge: bool) -> mx.array:
        """``[..., n]`` -> ``[..., n_groups, g]``, padding the last group.

        ``g = min(group_size, n)``: a segment narrower than ``group_size`` is one group
        and needs no padding (the same groups as padding it, without the wasted work).
        """
        n = x.shape[-1]
        g = min(self.group_size, n)
        n_groups = -(-n // g)
        pad = n_groups * g - n
        if pad:
            edge = x[..., -1:] if fill_edge else mx.zeros_like(x[..., -1:])
            x = mx.concatenate([x, mx.repeat(edge, pad, axis=-1)], axis=-1)
        return x.reshape(*x.shape[:-1], n_groups, g)

    def _quantize(self, x: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
        levels = (1 << bits) - 1
        # Replicating the last channel leaves the short group's min/max unchanged.
        groups = self._grouped(x, fill_edge=True)
        lo = mx.min(groups, axis=-1)
        hi = mx.max(groups, axis=-1)
        # Quantize against the stored (rounded) scale and bias so decode sees the same numbers.
        biases = lo.astype(self.scale_dtype)
        scales = ((hi - lo) / levels).astype(self.scale_dtype)
        scale32 = scales.astype(mx.float32)
        safe = mx.where(scale32 > 0, scale32, 1.0)
        q = mx.round((groups - biases.astype(mx.float32)[..., None]) / safe[..., None])
        q = mx.clip(q, 0, levels).astype(mx.uint32)
        codes = q.reshape(*q.shape[:-2], -1)[..., : x.shape[-1]]
        return codes, scales, biases

    def _dequantize(self, codes: mx.array, scales: mx.array, biases: mx.array, n: int) -> mx.array:
        groups = self._grouped(codes, fill_edge=False)
        x = groups * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
        return x.reshape(*x.shape[:-2], -1)[..., :n]


def _describe(arr) -> str:
    return f"{arr.dtype} {tuple(arr.shape)}" if isinstance(arr, mx.array) else type(arr).__name__
