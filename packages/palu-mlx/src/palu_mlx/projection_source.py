"""Where a palu cache's projections and latent coders come from.

A :class:`~palu_mlx.cache.PaluKVCache` codes every token the same way once it has, per tensor, a
projection and a coder; a **projection source** says where those come from, what the cache must
check of its inputs for them, and how they are written into and read back from a saved state:

* :class:`FitAtPrefill`: fitted on the tokens held when ``palu_min_fit_tokens`` have arrived (the
  config's coder, or a :class:`~palu_mlx.mixed_bit.BitAllocationPolicy`); until then the cache
  holds the tokens exactly. Its projections belong to the sequence and count in ``nbytes``.
* :class:`FromCalibration`: one layer's fixed per-KV-head projections and quantizers from a
  ``palu-mlx calibrate`` file (:func:`palu_mlx.calibrated.calibrated_caches`), there from the
  first token. They belong to the model and are counted apart (``constant_nbytes``).

The two sources write different state layouts (their names, arrays and metadata); each reads
back only its own, so a state saved by either loads as it always has.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import mlx.core as mx
from kvspec import KVConfigError, KVDataError, KVShapeError

from .coders.base import FitSettings, Fitted, LatentCoder, compact_dtype, projection_dtype
from .coders.fixed import FixedQuantCoder
from .coders.hilo import fit_mixed_bit
from .config import KVCacheConfig
from .distributed import HeadShard
from .layer import SUPPORTED_DTYPES, detached
from .lowrank import GroupProjection, PackedProjection
from .mixed_bit import BitAllocationPolicy, MixedBitCoder, check_policy
from .rope import Rotary
from .state_checks import StateArrays, read_field, read_rope, read_segments, read_widths

__all__ = [
    "ProjectionSource",
    "FitAtPrefill",
    "FromCalibration",
    "CalibratedTensor",
    "CODED_WITH",
    "StateRead",
    "SavedState",
]

PREFIXES = ("key", "value")


class ProjectionSource(Protocol):
    """What a :class:`~palu_mlx.cache.PaluKVCache` asks of the source of its projections."""

    #: True: the projections are the model's (saved first in a state, kept out of ``nbytes``)
    per_model: bool

    def initial(self) -> tuple[Fitted, Fitted] | None:
        """Keys' and values' projection and coder from the first token, or None (fitted later)."""
        ...

    def fit_tokens(self, head_dim: int) -> int:
        """Tokens held exactly before :meth:`fit` is called (only when :meth:`initial` is None)."""
        ...

    def fit(self, keys: mx.array, values: mx.array, dtype: mx.Dtype) -> tuple[Fitted, Fitted]:
        """Fit on every held token (keys before RoPE on the pre-RoPE path)."""
        ...

    def check_dims(self, h: int, d: int, dv: int, rotary: Rotary | None) -> None:
        """Reject head counts or head dims these projections cannot code."""
        ...

    def saved_arrays(self, projection: GroupProjection, coder: LatentCoder) -> dict[str, mx.array]:
        """One tensor's projection and coder constants as a state holds them (names without prefix)."""
        ...

    def meta(self, key_coder: LatentCoder | None, value_coder: LatentCoder | None) -> dict[str, Any]:
        """The runtime ``meta_state`` fields that describe the coders (None: not fitted yet)."""
        ...

    def describe(self, fitted: tuple[Fitted, Fitted] | None) -> str:
        """The ranks part of the cache's ``repr`` (``fitted``: keys' and values' projection and coder)."""
        ...

    @classmethod
    def read_state(cls, saved: SavedState, allocation_policy: BitAllocationPolicy | None = None) -> StateRead:
        """This source's state layout read back: the source, the RoPE and (once fitted) the coders."""
        ...


class SavedState(NamedTuple):
    """One ``from_state`` call's checked metadata (config, runtime fields, offset's shape and dtype)
    and its arrays, as a source reads its own part of them."""

    config: KVCacheConfig
    runtime: dict[str, Any]
    arrays: StateArrays
    shape: tuple[int, int, int, int] | None
    dtype: mx.Dtype | None
    owner: str


@dataclass(frozen=True)
class StateRead:
    """What a source reads back from a saved state: itself, the RoPE and, once fitted, the coders."""

    source: ProjectionSource
    rotary: Rotary | None
    fitted: tuple[Fitted, Fitted] | None


#: the config fields a fitted cache's arrays depend on: how latents were projected and coded, and
#: which tokens are held exactly; a fitted state records them (``coded_with``) so that a config
#: edited afterwards cannot reinterpret its codes
CODED_WITH: tuple[str, ...] = (
    "palu_bits",
    "palu_rank",
    "palu_energy_threshold",
    "palu_hi_bit",
    "palu_lo_bit",
    "palu_hi_fraction",
    "palu_group_size",
    "palu_quantize_values",
    "palu_token_scale",
    "palu_n_head_groups",
    "palu_sink_tokens",
    "palu_recent_tokens",
    "palu_basis_bits",
    "palu_scale_bits",
    "palu_recent_bits",
)


def compact_side(fitted: Fitted, config: KVCacheConfig) -> Fitted:
    """One tensor's fit with the config's compact side information: the basis as int8 codes per
    column (``palu_basis_bits=8``, quantized latents only) and the per-token scale as a one-byte
    log code (``palu_scale_bits=8``, fixed quantizers), and with ``palu_fill_rows`` the bits that
    round a fixed quantizer's row up to whole bytes spent on its channels
    (:meth:`~palu_mlx.coders.fixed.FixedQuantCoder.filled`); as given at the defaults."""
    proj, coder = fitted
    if config.palu_fill_rows and isinstance(coder, FixedQuantCoder):
        coder = coder.filled()
    if config.palu_basis_bits == 8 and coder.quantizes and isinstance(proj, GroupProjection):
        proj = PackedProjection.pack(proj)
    if config.palu_scale_bits == 8 and isinstance(coder, FixedQuantCoder):
        coder = dataclasses.replace(coder, scale_bits=8)
    return proj, coder


class FitAtPrefill:
    """Projections fitted on the tokens held when ``config.min_fit_tokens`` have arrived.

    Args:
        config: the cache's :class:`KVCacheConfig` (``palu_calibration`` must be None).
        allocation_policy: None: the config's coder (``config.coder_choice``) fits and codes. A
            :class:`~palu_mlx.mixed_bit.BitAllocationPolicy`: the mixed-bit coder with its widths.
        shard: under tensor parallel, this rank's :class:`~palu_mlx.distributed.HeadShard` (what
            spans heads is decided on every rank's statistics); None: a whole model.
    """

    per_model = False

    def __init__(
        self,
        config: KVCacheConfig,
        allocation_policy: BitAllocationPolicy | None = None,
        shard: HeadShard | None = None,
    ):
        if config.palu_calibration is not None:
            raise KVConfigError(
                f"palu_calibration={config.palu_calibration!r}: calibrated caches are built per model "
                "by KVCacheBuilder.for_model (CalibratedKVCache), not by PaluKVCache"
            )
        check_policy(allocation_policy)
        if shard is not None and not isinstance(shard, HeadShard):
            raise KVConfigError(
                f"shard must be a palu_mlx.distributed.HeadShard or None; got {type(shard).__name__}"
            )
        if shard is not None and config.palu_fill_rows:
            raise KVConfigError(
                "palu_fill_rows=True under tensor parallel: the filled widths would follow this rank's "
                "heads alone; allowed: False"
            )
        if shard is not None and config.palu_n_head_groups is not None:
            raise KVConfigError(
                f"palu_n_head_groups={config.palu_n_head_groups} under tensor parallel: each rank fits its "
                "own heads; allowed: None (one group per KV head)"
            )
        self.config = config
        self.allocation_policy = allocation_policy
        self.shard = shard

    def initial(self) -> None:
        return None

    def fit_tokens(self, head_dim: int) -> int:
        return self.config.min_fit_tokens(head_dim)

    def fit(self, keys: mx.array, values: mx.array, dtype: mx.Dtype) -> tuple[Fitted, Fitted]:
        cfg = self.config
        settings = FitSettings(
            groups=cfg.head_groups(keys.shape[1]),
            rank=cfg.palu_rank,
            energy_threshold=cfg.energy_threshold,
            group_size=cfg.palu_group_size,
            quantize_values=cfg.palu_quantize_values,
            dtype=dtype,
            gather=None if self.shard is None else self.shard.gather,
        )
        if self.allocation_policy is None:
            fitted = cfg.coder_choice.fit(keys, values, settings)
        else:
            fitted = fit_mixed_bit(keys, values, self.allocation_policy, settings)
        return compact_side(fitted[0], cfg), compact_side(fitted[1], cfg)

    def check_dims(self, h: int, d: int, dv: int, rotary: Rotary | None) -> None:
        cfg = self.config
        if cfg.head_dim is not None and d != cfg.head_dim:
            raise KVShapeError(f"keys head dim {d} does not match config head_dim={cfg.head_dim}")
        if self.shard is not None and h != self.shard.heads:
            raise KVShapeError(f"keys have {h} heads; this rank's shard holds {self.shard.heads}")
        if h % cfg.head_groups(h) != 0:
            raise KVConfigError(
                f"palu_n_head_groups={cfg.palu_n_head_groups} must divide the key/value head "
                f"count {h}; allowed: a divisor of {h}"
            )
        if rotary is not None and rotary.dims > d:
            raise KVShapeError(f"keys head dim {d} is smaller than the RoPE dims {rotary.dims}")
        if cfg.palu_rank is not None and cfg.palu_rank > min(d, dv):
            raise KVConfigError(
                f"palu_rank={cfg.palu_rank} exceeds the head dims (keys {d}, values {dv}); "
                f"allowed: 1..{min(d, dv)}"
            )

    def saved_arrays(self, projection: GroupProjection, coder: LatentCoder) -> dict[str, mx.array]:
        return {**projection.arrays(), **coder.constants()}

    def meta(self, key_coder: LatentCoder | None, value_coder: LatentCoder | None) -> dict[str, Any]:
        return {
            "key_segments": _segments_to_list(key_coder),
            "value_segments": _segments_to_list(value_coder),
            "key_fixed_widths": _fixed_widths(key_coder),
            "value_fixed_widths": _fixed_widths(value_coder),
            "coded_with": None if key_coder is None else {n: getattr(self.config, n) for n in CODED_WITH},
        }

    def describe(self, fitted: tuple[Fitted, Fitted] | None) -> str:
        if fitted is None:
            return "exact"
        (key_proj, _), (value_proj, _) = fitted
        return f"fitted r_k={key_proj.rank} r_v={value_proj.rank}"

    @classmethod
    def read_state(cls, saved: SavedState, allocation_policy: BitAllocationPolicy | None = None) -> StateRead:
        """The source, RoPE and (once fitted) coders of a state :meth:`meta` and :meth:`saved_arrays` wrote.

        Every field is checked (segment layouts against fixed widths, ``coded_with`` against the
        config, array names, shapes, dtypes): a mismatch raises ``KVDataError`` naming it.
        """
        config, runtime, arrays, shape, dtype, owner = saved
        if allocation_policy is not None and not isinstance(allocation_policy, BitAllocationPolicy):
            raise KVConfigError(
                f"allocation_policy must be a BitAllocationPolicy (with .allocate) or None; "
                f"got {type(allocation_policy).__name__}"
            )
        layout = {
            name: read_field(runtime, name, owner)
            for name in ("rope", "key_segments", "value_segments", "key_fixed_widths", "value_fixed_widths")
        }
        rotary = read_rotary(arrays, layout["rope"], shape[2] if shape else config.head_dim, owner)
        try:
            source = cls(config, allocation_policy)
        except KVConfigError as exc:
            raise KVDataError(f"{owner}: meta_state config: {exc}") from None
        fitted = layout["key_segments"] is not None
        if shape is None and any(layout[k] is not None for k in layout if k != "rope"):
            raise KVDataError(
                f"{owner}: meta_state of an empty cache must have null segments and fixed widths"
            )
        if fitted != (layout["value_segments"] is not None) or (
            not fitted
            and (layout["key_fixed_widths"] is not None or layout["value_fixed_widths"] is not None)
        ):
            raise KVDataError(
                f"{owner}: meta_state key_segments and value_segments must be both null (before the fit) or both "
                "set, and fixed widths need segments"
            )
        _check_coded_with(read_field(runtime, "coded_with", owner), config, fitted, owner)
        if shape is not None:
            _, h, d, dv = shape
            try:
                # the config is the state's (already checked), so a refusal here is the shape's
                source.check_dims(h, d, dv, rotary)
            except (KVConfigError, KVShapeError) as exc:
                raise KVDataError(f"{owner}: meta_state shape {list(shape)}: {exc}") from None
        if shape is None or not fitted:
            return StateRead(source, rotary, None)
        _, h, d, dv = shape
        parts = []
        for prefix, dim in (("key", d), ("value", dv)):
            segments = read_segments(layout[f"{prefix}_segments"], f"{prefix}_segments", owner)
            fixed = layout[f"{prefix}_fixed_widths"]
            if fixed is not None:
                widths = read_widths(fixed, f"{prefix}_fixed_widths", owner)
                steps = arrays.take(f"{prefix}.steps", (h, len(widths)), mx.float32, positive=True)
                coder = FixedQuantCoder(
                    widths, detached(steps), config.palu_token_scale, config.palu_scale_bits
                )
                if coder.segments != segments:
                    raise KVDataError(
                        f"{owner}: meta_state {prefix}_segments {layout[f'{prefix}_segments']} do not match "
                        f"{prefix}_fixed_widths {list(widths)}"
                    )
            else:
                coder = MixedBitCoder(segments, config.palu_group_size, dtype, compact_dtype(dtype))
            proj_dtype = projection_dtype(coder, dtype)
            g, r = config.head_groups(h), coder.rank
            if r > dim:
                raise KVDataError(f"{owner}: meta_state {prefix} rank {r} exceeds the head dim {dim}")
            if config.palu_basis_bits == 8 and coder.quantizes:
                packed = PackedProjection(
                    codes=detached(arrays.take(f"{prefix}.basis", (g, dim, r), mx.int8)),
                    column_scales=detached(arrays.take(f"{prefix}.basis_scale", (g, r), proj_dtype)),
                    mean=detached(arrays.take(f"{prefix}.mean", (g, dim), proj_dtype)),
                )
                parts.append((packed, coder))
                continue
            proj = GroupProjection(
                basis=arrays.take(f"{prefix}.basis", (g, dim, r), proj_dtype),
                mean=arrays.take(f"{prefix}.mean", (g, dim), proj_dtype),
                singular_values=arrays.take(f"{prefix}.singular_values", (g, r), proj_dtype),
            )
            parts.append((GroupProjection(**{k: detached(v) for k, v in proj.arrays().items()}), coder))
        return StateRead(source, rotary, (parts[0], parts[1]))


@dataclass(frozen=True)
class CalibratedTensor:
    """One tensor's calibrated code: per-KV-head projection (``n_groups = H``) and fixed quantizers."""

    projection: GroupProjection
    coder: FixedQuantCoder

    def arrays(self) -> dict[str, mx.array]:
        # singular_values are left out of the state: from_state fills them with the steps
        out = {n: a for n, a in self.projection.arrays().items() if n != "singular_values"}
        return {**out, "steps": self.coder.steps}


class FromCalibration:
    """One layer's projections and quantizers from a calibration (fixed from the first token).

    Args:
        key, value: the layer's :class:`CalibratedTensor` codes (see
            :func:`palu_mlx.calibrated.calibrated_caches`).
    """

    per_model = True

    def __init__(self, key: CalibratedTensor, value: CalibratedTensor):
        for name, code in (("key", key), ("value", value)):
            if not isinstance(code, CalibratedTensor):
                raise KVConfigError(
                    f"{name} must be a CalibratedTensor (a projection and FixedQuantCoder); "
                    f"got {type(code).__name__}"
                )
        self.key, self.value = key, value

    def initial(self) -> tuple[Fitted, Fitted]:
        return (self.key.projection, self.key.coder), (self.value.projection, self.value.coder)

    def fit_tokens(self, head_dim: int) -> int:
        return 0

    def fit(self, keys: mx.array, values: mx.array, dtype: mx.Dtype) -> tuple[Fitted, Fitted]:
        return self.initial()

    def check_dims(self, h: int, d: int, dv: int, rotary: Rotary | None) -> None:
        want = (self.key.projection.n_groups, self.key.projection.dim, self.value.projection.dim)
        if (h, d, dv) != want:
            raise KVShapeError(
                f"keys/values with (heads, D, Dv)={(h, d, dv)} do not match the calibration's {want}"
            )

    def saved_arrays(self, projection: GroupProjection, coder: LatentCoder) -> dict[str, mx.array]:
        return CalibratedTensor(projection, coder).arrays()

    def meta(self, key_coder: LatentCoder | None, value_coder: LatentCoder | None) -> dict[str, Any]:
        return {"key_widths": list(key_coder.widths), "value_widths": list(value_coder.widths)}

    def describe(self, fitted: tuple[Fitted, Fitted] | None) -> str:
        (_, key), (_, value) = fitted
        return f"r_k={key.rank} ({key.bits_per_row} bits), r_v={value.rank} ({value.bits_per_row} bits)"

    @classmethod
    def read_state(cls, saved: SavedState, allocation_policy: BitAllocationPolicy | None = None) -> StateRead:
        """The calibration constants a state holds (widths, bases, means, steps, decoders), checked:
        a mismatch raises ``KVDataError`` naming it."""
        config, runtime, arrays, shape, _, owner = saved
        if allocation_policy is not None:
            raise KVConfigError(
                "a calibrated cache takes no allocation_policy: its widths are the calibration's"
            )
        taken = {}
        for prefix in PREFIXES:
            widths = read_widths(read_field(runtime, f"{prefix}_widths", owner), f"{prefix}_widths", owner)
            name = f"{prefix}.basis"
            held = arrays.shape(name)
            if held is None or len(held) != 3:
                raise KVDataError(f"{owner}: state array {name!r} must be [H, D, r]; got {held or 'nothing'}")
            h, d, _ = held
            if shape is not None and (h, d) != (shape[1], shape[2] if prefix == "key" else shape[3]):
                raise KVDataError(
                    f"{owner}: state array {name!r} of shape {held} does not match meta_state shape {list(shape)}"
                )
            r = len(widths)
            basis = arrays.take(name, (h, d, r), SUPPORTED_DTYPES)
            mean = arrays.take(f"{prefix}.mean", (h, d), SUPPORTED_DTYPES)
            steps = arrays.take(f"{prefix}.steps", (h, r), mx.float32, positive=True)
            # a weighted calibration's decoder; states of unweighted ones have none
            decoder = (
                arrays.take(f"{prefix}.decoder", (h, d, r), SUPPORTED_DTYPES)
                if f"{prefix}.decoder" in arrays
                else None
            )
            taken[prefix] = (widths, basis, mean, steps, decoder)
        key_heads, value_heads = taken["key"][1].shape[0], taken["value"][1].shape[0]
        if key_heads != value_heads:
            raise KVDataError(
                f"{owner}: key.basis has {key_heads} heads but value.basis {value_heads}; they must agree"
            )
        rotary = read_rotary(arrays, read_field(runtime, "rope", owner), taken["key"][1].shape[1], owner)
        codes = {}
        for prefix, (widths, basis, mean, steps, decoder) in taken.items():
            steps = detached(steps)
            proj = GroupProjection(
                basis=detached(basis),
                mean=detached(mean),
                singular_values=steps,
                decoder=None if decoder is None else detached(decoder),
            )
            codes[prefix] = CalibratedTensor(proj, FixedQuantCoder(widths, steps, config.palu_token_scale))
        source = cls(codes["key"], codes["value"])
        return StateRead(source, rotary, source.initial())


def read_rotary(arrays: StateArrays, rope_meta: object, head_dim: int | None, owner: str) -> Rotary | None:
    rope = read_rope(rope_meta, head_dim, owner)
    if rope is None:
        return None
    inv_freq = arrays.take("rope.inv_freq", (rope[0] // 2,), mx.float32)
    return Rotary(detached(inv_freq), *rope)


def _check_coded_with(coded: object, config: KVCacheConfig, fitted: bool, owner: str) -> None:
    """KVDataError unless ``coded`` is None before the fit and, after it, names the fields of
    :data:`CODED_WITH` with the values ``config`` has."""
    if not fitted:
        if coded is not None:
            raise KVDataError(f"{owner}: meta_state coded_with={coded!r} must be null before the fit")
        return
    if not isinstance(coded, dict) or set(coded) != set(CODED_WITH):
        missing = sorted(set(CODED_WITH) - set(coded)) if isinstance(coded, dict) else []
        lacks = f" (it lacks {missing})" if missing else ""
        raise KVDataError(
            f"{owner}: meta_state coded_with={coded!r:.200} must be an object of the fields "
            f"{list(CODED_WITH)}{lacks}"
        )
    for name in CODED_WITH:
        if coded[name] != getattr(config, name):
            raise KVDataError(
                f"{owner}: meta_state config {name}={getattr(config, name)!r}, but the state's codes were made "
                f"with {name}={coded[name]!r}; allowed: {coded[name]!r} (a fitted cache keeps how it coded)"
            )


def _fixed_widths(coder: LatentCoder | None) -> list[int] | None:
    widths = None if coder is None else coder.fixed_widths
    return None if widths is None else list(widths)


def _segments_to_list(coder: LatentCoder | None) -> list[list[int]] | None:
    if coder is None:
        return None
    return [[s.start, s.stop, s.bits] for s in coder.segments]
