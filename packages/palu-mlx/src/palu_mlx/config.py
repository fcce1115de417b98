"""KVCacheConfig: every knob of the palu cache, checked once in ``__post_init__``.

A bad value raises :class:`kvspec.KVConfigError` naming the field, the value
given and what is allowed, so a typo fails at construction instead of deep in
a model forward.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import InitVar, asdict, dataclass, fields
from typing import Any

from kvspec import KVConfigError

from .coders.hilo import HiLoSplit
from .coders.water_filling import DEFAULT_PALU_BITS, WaterFilling, is_weight
from .mixed_bit import PACKABLE_BITS, UNQUANTIZED_BITS

__all__ = [
    "KVCacheConfig",
    "PACKABLE_BITS",
    "UNQUANTIZED_BITS",
    "METHODS",
    "DEFAULT_PALU_BITS",
    "REFERENCE_SPLIT",
    "DEFAULT_SINK_TOKENS",
    "DEFAULT_RECENT_TOKENS",
]

#: ``"palu"`` is the low-rank latent cache; ``"rotation"`` the code with nothing fitted but
#: means (:mod:`palu_mlx.rotation_code`); ``"naive"`` the uniform group-quant baseline.
METHODS: tuple[str, ...] = ("palu", "rotation", "naive")
#: code bits per rotated channel a ``method="rotation"`` config may ask for; a half (3.5) codes keys
#: with the bit above and values with the bit below
ROTATION_BITS_ALLOWED: tuple[float, ...] = tuple(b / 2 for b in range(4, 17))
#: tokens at the start of a sequence a config holds exactly unless it says otherwise
#: (``palu_sink_tokens``): real models' attention sinks sit on the first token or few
DEFAULT_SINK_TOKENS = 4
#: the newest tokens a config holds exactly unless it says otherwise (``palu_recent_tokens``)
DEFAULT_RECENT_TOKENS = 32
#: the reference's rank and hi/lo split (the ``reference-default`` tier), for the fields a
#: config leaves unset when it asks for the split
REFERENCE_SPLIT: dict[str, float] = {
    "palu_energy_threshold": 0.90,
    "palu_hi_bit": 4,
    "palu_lo_bit": 2,
    "palu_hi_fraction": 0.25,
}


def _is_int(value: Any) -> bool:
    # bool is an int subclass; True as a rank or bit width is always a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class KVCacheConfig:
    """Configuration of a palu (or naive baseline) KV cache.

    Attributes:
        method: ``"palu"`` (low-rank latent cache), ``"rotation"`` (nothing fitted but each
            head's mean: a fixed rotation of each head's channels and ``palu_bits`` bits, 4 by
            default, per rotated channel under a per-token scale, in halves from 2 to 8 (3.5: keys
            4, values 3), :mod:`palu_mlx.rotation_code`; the ``rotation-<b>bit`` tiers) or ``"naive"``
            (uniform group quantization of the full K/V, the comparison baseline).
        head_dim: the model's key head dimension ``D``; checked against the model
            and against every ``update_and_fetch``. ``None`` accepts the ``D`` of the
            first update (a cache not tied to one model, e.g. in conformance tests).
        palu_rank: explicit latent rank ``r`` in ``[1, head_dim]`` (and at most the value
            head dim); ``None`` selects the rank from ``palu_energy_threshold``.
        palu_energy_threshold: fraction in ``(0, 1]`` of the squared singular value
            energy each head group must retain when ``palu_rank`` is None (hi/lo split only;
            None: 0.90). One rank per
            tensor is used: the minimum over groups (buffers share one shape).
        palu_n_head_groups: NUMBER of contiguous head groups per layer; each group
            shares one projection. The layer's key/value head count must be divisible by it.
            ``None`` (the default): one group per KV head, which fits any head count (1, 2, 3,
            8, ...) and gives each head's pre-RoPE keys their own low-rank basis.
        palu_hi_bit, palu_lo_bit: bit widths of the top ``palu_hi_fraction`` latent
            channels (by singular value) and of the rest (hi/lo split only; None: 4 and 2).
            One of 1, 2, 3, 4, 5, 6, 8, or 16 for "keep those channels unquantized".
        palu_hi_fraction: fraction in ``[0, 1]`` of latent channels coded at ``palu_hi_bit``
            (``ceil(fraction * r)`` channels; hi/lo split only; None: 0.25).
        palu_group_size: channels sharing one scale/bias inside a bit-width segment
            (a positive integer; a segment whose width is not a multiple of it ends in a
            smaller group).
        palu_bits: target average code bits per original K/V element (a number in ``(0, 8]``).
            When set, the coder is :class:`~palu_mlx.coders.WaterFilling` and replaces the rank,
            the energy threshold and the hi/lo split: projections are fitted at full rank (or
            ``palu_rank``) and each latent channel gets an integer width 0-8 from its variance
            by reverse water-filling; 0 drops the channel. ``None`` (default): water-filling at
            :data:`DEFAULT_PALU_BITS`, unless any of ``palu_rank``, ``palu_energy_threshold``,
            ``palu_hi_bit``, ``palu_lo_bit``, ``palu_hi_fraction`` is set, which asks for the
            reference's rank + hi/lo split (unset ones from :data:`REFERENCE_SPLIT`).
        palu_calibration: path of a calibration file written by ``palu-mlx calibrate``
            (:class:`~palu_mlx.calibration.Calibration`). When set, ``KVCacheBuilder.for_model``
            builds :class:`~palu_mlx.calibrated.CalibratedKVCache` layers: fixed per-KV-head
            projections and quantizers from the file, widths by one water-filling level across
            all layers at ``palu_bits`` (:data:`DEFAULT_PALU_BITS` when None); rank, energy, hi/lo and
            group-size fields
            are then unused. A file made for another model raises ``KVConfigError``.
        palu_sensitivity: path of a sensitivity profile (:class:`~palu_mlx.budgets.SensitivityProfile`,
            written beside the model by ``benchmarks/palu/sensitivity.py``). When set,
            ``KVCacheBuilder.for_model`` spreads ``palu_bits`` (the average) over the layers and
            between keys and values by the model's measured sensitivity: each layer's cache gets
            this config with its own ``palu_bits``, ``palu_key_weight`` and ``palu_value_weight``
            (and ``palu_sensitivity`` None). Water-filling fitted at the prefill only; a profile
            made for a model of another shape raises ``KVConfigError``.
        palu_key_weight, palu_value_weight: what a unit of squared error in a key (value) latent
            channel costs, positive numbers (water-filling only): the layer's water-filling level
            runs over the channel variances times these. 1 and 1 (the default): keys and values alike.
        palu_relative_error: water-filling only: each tensor's variances are divided by its total
            variance before the level is set (:attr:`~palu_mlx.coders.WaterFilling.relative`), so keys
            and values are weighed by relative error, computed at the prefill with no file. False:
            by squared error. None (the default) is automatic (:attr:`relative_error` reads the
            outcome): relative error for the water-filling coder fitted at the prefill when nothing
            else chooses the weighing, i.e. no ``palu_calibration``, no ``palu_sensitivity`` and
            ``palu_key_weight`` / ``palu_value_weight`` left at 1; squared error otherwise (the hi/lo
            split, a calibration or a profile, explicit weights), as those were measured.
        palu_quantize_values: False keeps value latents unquantized (input dtype; fp16
            for fp16 models), still low-rank.
        palu_min_fit_tokens: tokens held exactly before the projections are fitted;
            ``None`` means ``D`` tokens (the key head dim), so every group sees at least
            ``D`` rows and a short prompt cannot lock in a degenerate low-rank subspace.
        palu_check_finite: reject NaN / inf keys and values (costs one device sync per
            layer call); False skips the check for speed.
        palu_pre_rope: when :meth:`KVCacheBuilder.for_model` builds caches for a model whose
            layers support it (probed by :func:`~palu_mlx.rope.model_rotaries`), code keys as they
            were before RoPE and rotate the reconstructed keys at their positions (see
            :mod:`palu_mlx.rope`); False, or a model whose layers do not (with a warning), caches
            the post-RoPE keys. A cache built
            without a model (``PaluKVCache(config)``) always codes the keys it is given.
        palu_token_scale: the bit-budget coder (``palu_bits``, fitted at the prefill or
            calibrated) stores one bfloat16 scale per token and head beside the codes, chosen so that
            no latent channel of 2 bits or more clips (see
            :class:`~palu_mlx.coders.fixed.FixedQuantCoder`); 16 bits per token, head and tensor on
            top of the budget. True by default; False: fixed ranges from the fit tokens'
            variance, no side information per token (the palu tiers that do not set it).
        palu_sink_tokens: the first this many tokens of a sequence are also kept exactly (input
            dtype) and attention reads them instead of their codes. Real models send a large share
            of attention (often half) to the first token, an attention sink whose values are far
            from the typical token's: a coding error there moves every later output. Default
            :data:`DEFAULT_SINK_TOKENS` (4); 0 keeps none.
        palu_recent_tokens: the newest this many tokens are also kept exactly (input dtype) and
            attention reads them instead of their codes (each token is coded when it arrives and
            read from its codes once newer ones push it out). Default :data:`DEFAULT_RECENT_TOKENS`
            (32); 0 keeps none.
        palu_basis_bits: 16 (the default) holds a basis fitted at the prefill in 16 bits; 8 holds
            it as int8 codes with one scale per column (:class:`~palu_mlx.lowrank.PackedProjection`),
            about half the bytes, for quantized latents. A per-sequence basis of full rank is about
            a tenth of mlx-lm's 4-bit cache at 2,048 tokens on a model with 64-wide heads.
        palu_scale_bits: 16 (the default) stores the per-token scale (``palu_token_scale``) as a
            bfloat16; 8 as a one-byte log code (:func:`~palu_mlx.coders.fixed.store_scales`), rounded
            up so nothing clips: steps up to 4.4% coarser, one byte less per token, head and tensor.
        palu_recent_bits: 16 (the default) keeps the ``palu_recent_tokens`` as given; 8 keeps them
            as int8 with one scale per token and head (:class:`~palu_mlx.sinks.RecentWindow`).
        palu_fill_rows: False (the default) leaves the bits that round each row of codes up to whole
            bytes unused; True gives them to the row's channels (water-filling's rule,
            :meth:`~palu_mlx.coders.fixed.FixedQuantCoder.filled`): the same bytes, less error.
            Fixed quantizers fitted at the prefill, one process (not under tensor parallel).
        naive_bits, naive_group_size: bit width and group size of the ``"naive"`` baseline
            (uniform ``mx.quantize`` of the full K/V; group size 32, 64 or 128).
        coder: (init only) the latent coder as an object, :class:`~palu_mlx.coders.WaterFilling`
            or :class:`~palu_mlx.coders.HiLoSplit`, instead of the ``palu_*`` fields that choose
            it: it writes its own fields (``WaterFilling``: ``palu_bits``, ``palu_token_scale``;
            ``HiLoSplit``: ``palu_hi_bit``, ``palu_lo_bit``, ``palu_hi_fraction``), and the other
            choosing fields (``palu_bits``, ``palu_energy_threshold``, ``palu_hi_bit``,
            ``palu_lo_bit``, ``palu_hi_fraction``) must be left unset or agree with it. Either
            way :attr:`coder_choice` reads the choice back as an object.
    """

    method: str = "palu"
    head_dim: int | None = None
    palu_rank: int | None = None
    palu_energy_threshold: float | None = None
    palu_n_head_groups: int | None = None
    palu_hi_bit: int | None = None
    palu_lo_bit: int | None = None
    palu_hi_fraction: float | None = None
    palu_group_size: int = 32
    palu_quantize_values: bool = True
    palu_bits: float | None = None
    palu_calibration: str | None = None
    palu_sensitivity: str | None = None
    palu_key_weight: float = 1.0
    palu_value_weight: float = 1.0
    palu_relative_error: bool | None = None
    palu_min_fit_tokens: int | None = None
    palu_check_finite: bool = True
    palu_pre_rope: bool = True
    palu_token_scale: bool = True
    palu_sink_tokens: int = DEFAULT_SINK_TOKENS
    palu_recent_tokens: int = DEFAULT_RECENT_TOKENS
    palu_basis_bits: int = 16
    palu_scale_bits: int = 16
    palu_recent_bits: int = 16
    palu_fill_rows: bool = False
    naive_bits: int = 2
    naive_group_size: int = 64
    coder: InitVar[HiLoSplit | WaterFilling | None] = None

    def __post_init__(self, coder: HiLoSplit | WaterFilling | None) -> None:
        if coder is not None:
            self._take_coder(coder)
        if self.method not in METHODS:
            raise KVConfigError(f"method={self.method!r} is not supported; allowed: {', '.join(METHODS)}")
        if self.head_dim is not None and (not _is_int(self.head_dim) or self.head_dim < 1):
            raise KVConfigError(
                f"head_dim={self.head_dim!r} must be a positive integer (the model's head dim) or None"
            )
        if self.palu_rank is not None and (
            not _is_int(self.palu_rank)
            or self.palu_rank < 1
            or (self.head_dim is not None and self.palu_rank > self.head_dim)
        ):
            raise KVConfigError(
                f"palu_rank={self.palu_rank!r} must be None or an integer in [1, head_dim={self.head_dim}]"
            )
        t = self.palu_energy_threshold
        if t is not None and (not _is_real(t) or not math.isfinite(t) or not 0.0 < t <= 1.0):
            raise KVConfigError(f"palu_energy_threshold={t!r} must be None or a number in (0, 1]")
        if self.palu_n_head_groups is not None and (
            not _is_int(self.palu_n_head_groups) or self.palu_n_head_groups < 1
        ):
            raise KVConfigError(
                f"palu_n_head_groups={self.palu_n_head_groups!r} must be None (one group per KV head) "
                "or a positive integer (the number of head groups; the layer's KV head count must be "
                "divisible by it)"
            )
        allowed = (*PACKABLE_BITS, UNQUANTIZED_BITS)
        for name in ("palu_hi_bit", "palu_lo_bit"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value not in allowed):
                raise KVConfigError(
                    f"{name}={value!r} cannot be packed; allowed: None, {', '.join(map(str, allowed))} "
                    "(16 = keep unquantized)"
                )
        f = self.palu_hi_fraction
        if f is not None and (not _is_real(f) or not math.isfinite(f) or not 0.0 <= f <= 1.0):
            raise KVConfigError(f"palu_hi_fraction={f!r} must be None or a number in [0, 1]")
        if not _is_int(self.palu_group_size) or self.palu_group_size < 1:
            raise KVConfigError(f"palu_group_size={self.palu_group_size!r} must be a positive integer")
        b = self.palu_bits
        if b is not None and (not _is_real(b) or not math.isfinite(b) or not 0.0 < b <= 8.0):
            raise KVConfigError(f"palu_bits={b!r} must be None or a number in (0, 8] (code bits per element)")
        if isinstance(self.palu_calibration, os.PathLike):
            object.__setattr__(self, "palu_calibration", os.fspath(self.palu_calibration))
        if self.palu_calibration is not None and (
            not isinstance(self.palu_calibration, str) or not self.palu_calibration
        ):
            raise KVConfigError(f"palu_calibration={self.palu_calibration!r} must be None or a file path")
        if isinstance(self.palu_sensitivity, os.PathLike):
            object.__setattr__(self, "palu_sensitivity", os.fspath(self.palu_sensitivity))
        if self.palu_sensitivity is not None and (
            not isinstance(self.palu_sensitivity, str) or not self.palu_sensitivity
        ):
            raise KVConfigError(
                f"palu_sensitivity={self.palu_sensitivity!r} must be None or a file path (a sensitivity profile)"
            )
        if self.palu_relative_error is not None and not isinstance(self.palu_relative_error, bool):
            raise KVConfigError(
                f"palu_relative_error={self.palu_relative_error!r} must be None (automatic), True or False"
            )
        for name in ("palu_key_weight", "palu_value_weight"):
            if not is_weight(getattr(self, name)):
                raise KVConfigError(
                    f"{name}={getattr(self, name)!r} must be a finite number > 0 (a water-filling weight)"
                )
        if not isinstance(self.palu_quantize_values, bool):
            raise KVConfigError(f"palu_quantize_values={self.palu_quantize_values!r} must be True or False")
        if self.palu_min_fit_tokens is not None and (
            not _is_int(self.palu_min_fit_tokens) or self.palu_min_fit_tokens < 1
        ):
            raise KVConfigError(
                f"palu_min_fit_tokens={self.palu_min_fit_tokens!r} must be None (= head_dim) "
                "or a positive integer"
            )
        if not isinstance(self.palu_check_finite, bool):
            raise KVConfigError(f"palu_check_finite={self.palu_check_finite!r} must be True or False")
        if not isinstance(self.palu_pre_rope, bool):
            raise KVConfigError(f"palu_pre_rope={self.palu_pre_rope!r} must be True or False")
        if not _is_int(self.palu_sink_tokens) or self.palu_sink_tokens < 0:
            raise KVConfigError(
                f"palu_sink_tokens={self.palu_sink_tokens!r} must be a non-negative integer "
                "(tokens at the start of the sequence kept exactly)"
            )
        if not _is_int(self.palu_recent_tokens) or self.palu_recent_tokens < 0:
            raise KVConfigError(
                f"palu_recent_tokens={self.palu_recent_tokens!r} must be a non-negative integer "
                "(the newest tokens kept exactly)"
            )
        if not isinstance(self.palu_token_scale, bool):
            raise KVConfigError(f"palu_token_scale={self.palu_token_scale!r} must be True or False")
        for name in ("palu_basis_bits", "palu_scale_bits", "palu_recent_bits"):
            value = getattr(self, name)
            if not _is_int(value) or value not in (16, 8):
                raise KVConfigError(f"{name}={value!r} must be 16 (as given) or 8 (compact)")
        if not isinstance(self.palu_fill_rows, bool):
            raise KVConfigError(f"palu_fill_rows={self.palu_fill_rows!r} must be True or False")
        if self.palu_calibration is not None and self.palu_fill_rows:
            raise KVConfigError(
                f"palu_fill_rows=True with palu_calibration={self.palu_calibration!r}: a calibration fixes "
                "the widths; allowed: False"
            )
        if self.palu_calibration is not None and (self.palu_basis_bits, self.palu_scale_bits) != (16, 16):
            raise KVConfigError(
                f"palu_basis_bits={self.palu_basis_bits} and palu_scale_bits={self.palu_scale_bits} with "
                f"palu_calibration={self.palu_calibration!r}: the compact basis and scales are for caches "
                "fitted at the prefill; allowed: 16 and 16"
            )
        if self.method == "rotation":
            self._check_rotation()
        if not _is_int(self.naive_bits) or self.naive_bits not in PACKABLE_BITS:
            raise KVConfigError(
                f"naive_bits={self.naive_bits!r} cannot be packed; allowed: {', '.join(map(str, PACKABLE_BITS))}"
            )
        if self.naive_group_size not in (32, 64, 128) or not _is_int(self.naive_group_size):
            raise KVConfigError(f"naive_group_size={self.naive_group_size!r} must be 32, 64 or 128")
        weighted = (self.palu_key_weight, self.palu_value_weight) != (1.0, 1.0) or bool(
            self.palu_relative_error
        )
        if (weighted or self.palu_sensitivity is not None) and self.uses_split:
            raise KVConfigError(
                "palu_sensitivity, palu_relative_error and the palu_key_weight / palu_value_weight water-filling "
                "weights need the "
                "water-filling coder (palu_bits); this config asks for the rank + hi/lo split"
            )
        if self.palu_sensitivity is not None and self.palu_calibration is not None:
            raise KVConfigError(
                f"palu_sensitivity={self.palu_sensitivity!r} and palu_calibration={self.palu_calibration!r}: "
                "the sensitivity budgets are for caches fitted at the prefill; allowed: one of them"
            )

    def _check_rotation(self) -> None:
        """``method="rotation"``: bits per rotated channel in halves from 2 to 8, a per-token scale,
        and none of the fields of a fitted or calibrated projection."""
        bits = self.palu_bits
        if bits is not None and float(bits) not in ROTATION_BITS_ALLOWED:
            raise KVConfigError(
                f"palu_bits={bits!r} with method='rotation' must be None (4) or one of "
                f"{', '.join(f'{b:g}' for b in ROTATION_BITS_ALLOWED)} (bits per rotated channel; a half "
                "gives keys the bit above and values the bit below)"
            )
        fitted = ("palu_rank", "palu_energy_threshold", "palu_hi_bit", "palu_lo_bit", "palu_hi_fraction",
                  "palu_calibration", "palu_sensitivity", "palu_n_head_groups")  # fmt: skip
        if not self.palu_token_scale:
            raise KVConfigError(
                "palu_token_scale=False with method='rotation': the rotation code's steps are relative to "
                "a per-token scale; allowed: True (the default)"
            )
        given = [name for name in fitted if getattr(self, name) is not None]
        if given:
            raise KVConfigError(
                f"{', '.join(given)} with method='rotation': the rotation code fits no projection; "
                "allowed: leave them unset (or use method='palu')"
            )

    def _take_coder(self, coder: Any) -> None:
        """Write ``coder``'s fields (``coder=`` given): each choosing field must be unset or agree."""
        if isinstance(coder, WaterFilling):
            owned = {"palu_bits": coder.bits, "palu_token_scale": coder.token_scale}
            for name, w in (("palu_key_weight", coder.key_weight), ("palu_value_weight", coder.value_weight)):
                if getattr(self, name) not in (1.0, w):
                    raise KVConfigError(
                        f"coder={coder!r} and {name}={getattr(self, name)!r} both set the weight; allowed: "
                        f"one of them ({name} left at 1, or equal to the coder's)"
                    )
                owned[name] = w
            if self.palu_relative_error is not None and self.palu_relative_error != coder.relative:
                raise KVConfigError(
                    f"coder={coder!r} and palu_relative_error={self.palu_relative_error!r} both choose the "
                    "weighing; allowed: one of them (palu_relative_error left at None, or equal to the "
                    "coder's relative)"
                )
            owned["palu_relative_error"] = coder.relative
        elif isinstance(coder, HiLoSplit):
            owned = {
                "palu_hi_bit": coder.hi_bit,
                "palu_lo_bit": coder.lo_bit,
                "palu_hi_fraction": coder.hi_fraction,
            }
        else:
            raise KVConfigError(
                f"coder={coder!r} must be None, palu_mlx.coders.WaterFilling or palu_mlx.coders.HiLoSplit"
            )
        for name in _CHOOSING:
            value = getattr(self, name)
            if value is not None and owned.get(name, _UNSET) != value:
                raise KVConfigError(
                    f"coder={coder!r} and {name}={value!r} both choose the coder; allowed: one of them "
                    f"({name} unset, or equal to what the coder says)"
                )
        for name, value in owned.items():
            object.__setattr__(self, name, value)

    @property
    def uses_split(self) -> bool:
        """Whether the latents are coded by the reference's rank + hi/lo split (:attr:`coder_choice` is a
        :class:`~palu_mlx.coders.HiLoSplit`)."""
        return isinstance(self.coder_choice, HiLoSplit)

    @property
    def relative_error(self) -> bool:
        """Whether the water-filling level weighs relative error (:attr:`coder_choice`'s
        :attr:`~palu_mlx.coders.WaterFilling.relative_error`): ``palu_relative_error``, or when it is
        None True for the water-filling coder fitted at the prefill with no ``palu_calibration``, no
        ``palu_sensitivity`` and both weights 1; False for the hi/lo split and the rotation code."""
        if self.method == "rotation":
            return False
        coder = self.coder_choice
        return isinstance(coder, WaterFilling) and coder.relative_error

    @property
    def coder_bits(self) -> float | None:
        """Code bits per element of the water-filling coder (:attr:`coder_choice`'s ``bits``); None for
        the hi/lo split."""
        coder = self.coder_choice
        return coder.bits if isinstance(coder, WaterFilling) else None

    def _split(self, name: str) -> float:
        value = getattr(self, name)
        return REFERENCE_SPLIT[name] if value is None else value

    @property
    def energy_threshold(self) -> float:
        """``palu_energy_threshold``, or the reference's 0.90 when unset."""
        return self._split("palu_energy_threshold")

    @property
    def hi_bit(self) -> int:
        """``palu_hi_bit``, or the reference's 4 when unset."""
        return self._split("palu_hi_bit")

    @property
    def lo_bit(self) -> int:
        """``palu_lo_bit``, or the reference's 2 when unset."""
        return self._split("palu_lo_bit")

    @property
    def hi_fraction(self) -> float:
        """``palu_hi_fraction``, or the reference's 0.25 when unset."""
        return self._split("palu_hi_fraction")

    def for_head_dim(self, head_dim: int | None) -> KVCacheConfig:
        """This config for a model whose key head dim is ``head_dim`` (None: unknown).

        ``head_dim`` left None takes the model's, so ``KVCacheConfig()`` fits any model; the other
        model-dependent fields stay None and are read from the layer (one head group per KV head,
        ``head_dim`` tokens before the fit). A different ``head_dim`` given, or a ``palu_rank`` above
        the model's head dim, raises ``KVConfigError``; ``self`` is never changed.
        """
        if head_dim is None or self.head_dim == head_dim:
            return self
        if self.head_dim is not None:
            raise KVConfigError(
                f"head_dim={self.head_dim} does not match the model's head_dim {head_dim}; "
                f"allowed: {head_dim}, or None to take the model's"
            )
        if self.palu_rank is not None and self.palu_rank > head_dim:
            raise KVConfigError(
                f"palu_rank={self.palu_rank} exceeds the model's head_dim {head_dim}; "
                f"allowed: None or an integer in [1, {head_dim}]"
            )
        return dataclasses.replace(self, head_dim=head_dim)

    def head_groups(self, n_heads: int) -> int:
        """Head groups for a layer of ``n_heads`` KV heads: ``palu_n_head_groups``, or one per head
        when it is None. (Whether it divides ``n_heads`` is checked where the heads are known.)"""
        return n_heads if self.palu_n_head_groups is None else self.palu_n_head_groups

    def min_fit_tokens(self, dim: int) -> int:
        """Tokens held exactly before fitting: ``palu_min_fit_tokens``, or the key head dim ``dim``."""
        return dim if self.palu_min_fit_tokens is None else self.palu_min_fit_tokens

    def to_json(self) -> str:
        """The configuration as a JSON string (used in ``meta_state``)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVCacheConfig:
        """Inverse of :meth:`to_json`; unknown keys, invalid JSON or values raise ``KVConfigError``."""
        if not isinstance(text, str):
            raise KVConfigError(f"KVCacheConfig.from_json needs a JSON string; got {type(text).__name__}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KVConfigError(f"KVCacheConfig.from_json: the text is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise KVConfigError(f"KVCacheConfig.from_json needs a JSON object; got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise KVConfigError(f"unknown KVCacheConfig fields {unknown}; known: {sorted(known)}")
        return cls(**data)


def _coder(config: KVCacheConfig) -> HiLoSplit | WaterFilling:
    """The latent coder the config chooses, as an object: the one place its fields are read as a choice.

    :class:`~palu_mlx.coders.HiLoSplit` when ``palu_bits`` is None and any of ``palu_rank``,
    ``palu_energy_threshold``, ``palu_hi_bit``, ``palu_lo_bit`` or ``palu_hi_fraction`` is set
    (unset widths take :data:`REFERENCE_SPLIT`'s); otherwise
    :class:`~palu_mlx.coders.WaterFilling` at ``palu_bits`` (:data:`DEFAULT_PALU_BITS` when None)
    with ``palu_token_scale``, the weights and the weighing resolved (``relative`` True or False, never
    None: a calibration or a sensitivity profile turns the automatic weighing off).
    """
    split = (
        config.palu_rank,
        config.palu_energy_threshold,
        config.palu_hi_bit,
        config.palu_lo_bit,
        config.palu_hi_fraction,
    )
    if config.palu_bits is None and any(v is not None for v in split):
        return HiLoSplit(config.hi_bit, config.lo_bit, config.hi_fraction)
    bits = DEFAULT_PALU_BITS if config.palu_bits is None else config.palu_bits
    relative = config.palu_relative_error
    if relative is None and (config.palu_calibration is not None or config.palu_sensitivity is not None):
        # a calibration sets its own widths and a profile's weights are per unit of squared error
        relative = False
    coder = WaterFilling(
        bits, config.palu_token_scale, config.palu_key_weight, config.palu_value_weight, relative
    )
    return dataclasses.replace(coder, relative=coder.relative_error)


# A property set after the class is made: the dataclass decorator takes every annotated class
# attribute for a field, and ``coder`` (the init-only argument) must not have one of this name,
# or dataclasses.replace would pass the property's value back in as ``coder=``.
KVCacheConfig.coder_choice = property(_coder)  # type: ignore[attr-defined]

#: the fields that choose the coder (``coder=`` must not be contradicted by them)
_CHOOSING = ("palu_bits", "palu_energy_threshold", "palu_hi_bit", "palu_lo_bit", "palu_hi_fraction")
_UNSET = object()
