"""The palu tiers a user picks from: every named configuration of the palu cache, defined here.

A tier is a name, a one-line description, a :class:`KVCacheConfig` and, where it needs one, the
calibration it needs. :data:`TIERS` holds at most eight, chosen from the bytes/KL frontier measured
on a real model (``benchmarks/results/palu_frontier.json``, ``palu_real_model.json``): the rotation
tiers, the fitted tiers below them, and ``reference-default``, the reference description's settings.
:data:`DEFAULT_TIER` names the one to use when nothing else is asked for. Configurations measured by
studies and not offered here live in ``benchmarks/studies/palu_tiers.py``, built with the helpers
exported below. The conformance adapter (:mod:`palu_mlx.kvspec_adapter`) adds capabilities and
tolerances to the tiers of :data:`TIERS`; adding a tier is one entry here plus its promises there.

:data:`CALIBRATED_TIERS` holds the calibrated twin of every tier with a bit budget
(``<tier>+cal``): the same config coded with fixed projections and quantizers from a
``palu-mlx calibrate`` file made for the model it runs on (``calibration="model"``). A
calibration is per model, so the registry names the kind and :meth:`Tier.with_calibration`
binds a file; those twins are not in :data:`TIERS` because the conformance suite and the
model-free runners have no model to calibrate.

Every tier has ``head_dim=None`` and one projection per KV head (``palu_n_head_groups=None``), so
one tier serves any ``[B, H, S, D]`` input. :meth:`Tier.for_head_dim` is the one way a tier is sized
for a model (``palu-mlx compare``, ``palu-mlx generate`` / ``server`` and the benchmarks all read it):
the model's head dim, ranks capped at it and the full-rank tier at it, so the config a results
file records under a tier's name is this registry's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kvspec import KVConfigError

from .config import DEFAULT_RECENT_TOKENS as RECENT_TOKENS
from .config import DEFAULT_SINK_TOKENS as SINK_TOKENS
from .config import REFERENCE_SPLIT, UNQUANTIZED_BITS, KVCacheConfig

__all__ = [
    "Tier",
    "TIERS",
    "DEFAULT_TIER",
    "CALIBRATED_TIERS",
    "CALIBRATED_SUFFIX",
    "SENSITIVITY_TIERS",
    "SENSITIVITY_SUFFIX",
    "CALIBRATIONS",
    "TIER_METHODS",
    "MAX_TIERS",
    "tier",
    # the builders, for the study registry (benchmarks/studies/palu_tiers.py)
    "palu_config",
    "SCALED",
    "UNQUANTIZED",
    "scaled_tier",
    "relative_tier",
    "compact_tier",
    "fixed_tier",
    "rotation_tier",
    "calibrated_twins",
    "sensitivity_twin",
    "sensitivity_twins",
]

#: what a tier may need: ``"model"``, a ``palu-mlx calibrate`` file made for the model it runs on;
#: ``"sensitivity"``, a sensitivity profile of that model (:mod:`palu_mlx.budgets`)
CALIBRATIONS: tuple[str, ...] = ("model", "sensitivity")
#: the methods a tier may have: the fitted latent cache and the rotation code (nothing fitted)
TIER_METHODS: tuple[str, ...] = ("palu", "rotation")
#: the end of a calibrated twin's name (``palu-2bit-scaled+cal``)
CALIBRATED_SUFFIX = "+cal"
#: the end of a sensitivity-budget twin's name (``palu-2bit-scaled+sens``)
SENSITIVITY_SUFFIX = "+sens"
#: the most tiers one registry (:data:`TIERS`, :data:`CALIBRATED_TIERS`,
#: :data:`SENSITIVITY_TIERS`) may hold: a user reads the whole list to choose
MAX_TIERS = 8
#: the tier to use when nothing else is asked for: at 0.87x mlx-lm q4's bytes it has 0.19x its KL
#: on SmolLM2-135M at 2,048 tokens, and fits nothing, so short prompts pay no basis
#: (``benchmarks/results/palu_frontier.json``, ``palu_short_chats.json``)
DEFAULT_TIER = "rotation-3.5bit"


@dataclass(frozen=True)
class Tier:
    """One named palu configuration.

    Attributes:
        name: the tier's one name everywhere (results files, command lines, test ids).
        description: one line saying what the tier is (rank or energy, bits).
        config: the :class:`KVCacheConfig` (``method`` one of :data:`TIER_METHODS`).
        calibration: None (the tier fits its projections at the prefill), or one of
            :data:`CALIBRATIONS`: the calibration the tier needs, given a file by
            :meth:`with_calibration` (its ``config.palu_calibration`` is None until then).
        full_rank: the tier's rank is the model's whole head dim (:meth:`for_head_dim`); its
            ``config.palu_rank`` is the rank it has on 64-wide heads, for inputs of no model.
    """

    name: str
    description: str
    config: KVCacheConfig
    calibration: str | None = None
    full_rank: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip():
            raise KVConfigError(f"name={self.name!r} must be a non-empty string without outer spaces")
        if not isinstance(self.description, str) or not self.description.strip() or "\n" in self.description:
            raise KVConfigError(f"description={self.description!r} must be one non-empty line")
        if not isinstance(self.config, KVCacheConfig) or self.config.method not in TIER_METHODS:
            raise KVConfigError(
                f"config={self.config!r} must be a KVCacheConfig with method in {', '.join(map(repr, TIER_METHODS))}"
            )
        if self.calibration is not None and self.calibration not in CALIBRATIONS:
            raise KVConfigError(
                f"calibration={self.calibration!r} must be None or one of {', '.join(map(repr, CALIBRATIONS))}"
            )
        if not isinstance(self.full_rank, bool) or (self.full_rank and self.config.palu_rank is None):
            raise KVConfigError(
                f"full_rank={self.full_rank!r} must be True or False (True only with a config.palu_rank)"
            )

    def for_head_dim(self, head_dim: int) -> KVCacheConfig:
        """The config this tier runs as on a model whose key head dim is ``head_dim``.

        :attr:`config` with that ``head_dim`` (:meth:`KVCacheConfig.for_head_dim`), its rank capped
        at it (the full-rank tier's rank becoming it), everything else as registered: one projection
        per KV head. A calibrated tier must be bound to its file first (:meth:`with_calibration`).
        Raises ``KVConfigError`` for a ``head_dim`` that is not a positive integer or an unbound
        calibrated tier.
        """
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise KVConfigError(
                f"head_dim={head_dim!r} must be a positive integer (the model's key head dim)"
            )
        config = self.config
        if self.calibration is not None and (config.palu_calibration or config.palu_sensitivity) is None:
            what = "a calibration file" if self.calibration == "model" else "a sensitivity profile"
            raise KVConfigError(
                f"tier {self.name!r} needs {what} for the model; bind it with Tier.with_calibration(path) first"
            )
        rank = config.palu_rank
        if rank is not None:
            rank = head_dim if self.full_rank else min(rank, head_dim)
        return config.replace(palu_rank=rank).for_head_dim(head_dim)

    def sized(self, head_dim: int, calibration: str | None = None) -> KVCacheConfig:
        """The config this tier runs as on a model whose key head dim is ``head_dim``, bound to
        ``calibration`` (the model's file) when the tier needs one (:meth:`with_calibration`, then
        :meth:`for_head_dim`). Raises ``KVConfigError`` for a calibrated tier without a file, or a
        file given to a tier that takes none.
        """
        chosen = self
        if self.calibration is not None:
            if calibration is None:
                raise KVConfigError(
                    f"tier {self.name!r} needs calibration=<a palu-mlx calibrate file for the model>"
                )
            chosen = self.with_calibration(calibration)
        elif calibration is not None:
            raise KVConfigError(f"tier {self.name!r} takes no calibration; got calibration={calibration!r}")
        return chosen.for_head_dim(head_dim)

    def with_calibration(self, path: str) -> Tier:
        """This calibrated tier bound to ``path``, the file for the model it runs on: a ``palu-mlx
        calibrate`` file (``calibration="model"``) or a sensitivity profile (``"sensitivity"``).

        Its config gets ``palu_calibration=path`` (``palu_sensitivity=path``) and its description
        names the file. Raises ``KVConfigError`` on a tier that needs no calibration or a path that
        is not a non-empty str.
        """
        if self.calibration is None:
            raise KVConfigError(f"tier {self.name!r} needs no calibration; only calibrated tiers take a file")
        if not isinstance(path, str) or not path:
            what = "a palu-mlx calibrate file" if self.calibration == "model" else "a sensitivity profile"
            raise KVConfigError(f"path={path!r} must be a non-empty str ({what})")
        if self.calibration == "sensitivity":
            description = self.description.removesuffix(_UNBOUND_SENSITIVITY)
            return dataclasses.replace(
                self,
                description=f"{description}; bits per layer from the sensitivity profile {Path(path).name}",
                config=self.config.replace(palu_sensitivity=path),
            )
        description = self.description.removesuffix(_UNBOUND_NOTE)
        return dataclasses.replace(
            self,
            description=f"{description}; calibrated ({Path(path).name}): fixed projections and quantizers",
            config=self.config.replace(palu_calibration=path),
        )


def palu_config(**fields) -> KVCacheConfig:
    """The base of every palu tier with ``fields`` set: the coder's codes alone, without a per-token
    scale, without exact first or newest tokens, weighed by squared error."""
    # stated here rather than left to KVCacheConfig's defaults: a tier that uses one sets it in its
    # own fields (SCALED; palu_relative_error=True in the "+rel" tiers), so a tier is exactly the
    # configuration its fields spell out, whatever the defaults become
    fields = {
        "palu_token_scale": False,
        "palu_sink_tokens": 0,
        "palu_recent_tokens": 0,
        "palu_relative_error": False,
        **fields,
    }
    return KVCacheConfig(method="palu", head_dim=None, **fields)


#: the coder for real models' K/V: a per-token scale beside the fixed quantizers, the first tokens
#: (attention sinks) and the newest tokens held exactly
SCALED = dict(palu_token_scale=True, palu_sink_tokens=SINK_TOKENS, palu_recent_tokens=RECENT_TOKENS)
#: latents left unquantized (the rank alone loses anything)
UNQUANTIZED = dict(palu_hi_bit=UNQUANTIZED_BITS, palu_lo_bit=UNQUANTIZED_BITS)


def _scaled(bits: float) -> str:
    return (
        f"keys before RoPE where supported, {bits:g} code bits per element by water-filling, "
        f"fixed quantizers fitted at the prefill with a per-token scale, the first {SINK_TOKENS} "
        f"and the newest {RECENT_TOKENS} tokens exact"
    )


def _relative(bits: float) -> str:
    return _scaled(bits) + ", keys and values weighed by relative error at the prefill"


#: the scaled coder with its side information in 8 bits: the basis as int8 codes per column, the
#: per-token scale as a one-byte log code and the newest tokens as int8 (about 0.09x of mlx-lm q4's
#: bytes less on SmolLM2-135M at 2,048 tokens: ``benchmarks/results/palu_byte_breakdown.json``)
_COMPACT = dict(SCALED, palu_basis_bits=8, palu_scale_bits=8, palu_recent_bits=8)


def compact_tier(bits: float, fill: bool = False) -> Tier:
    """``palu-<bits>bit-compact``: the scaled coder with its side information in 8 bits; with
    ``fill``, ``palu-<bits>bit-compact-fill``: the bits that round each row up to whole bytes go to
    its channels."""
    description = (
        f"keys before RoPE where supported, {bits:g} code bits per element by water-filling, "
        "fixed quantizers fitted at the prefill with a one-byte per-token scale, the basis in 8 bits, "
        f"the first {SINK_TOKENS} tokens exact and the newest {RECENT_TOKENS} in int8"
    )
    if fill:
        description += ", rows filled to whole bytes"
        return Tier(
            f"palu-{bits:g}bit-compact-fill",
            description,
            palu_config(palu_bits=float(bits), palu_fill_rows=True, **_COMPACT),
        )
    return Tier(f"palu-{bits:g}bit-compact", description, palu_config(palu_bits=float(bits), **_COMPACT))


def scaled_tier(bits: float) -> Tier:
    """``palu-<bits>bit-scaled``: water-filling with a per-token scale and exact first and newest
    tokens, weighed by squared error."""
    return Tier(f"palu-{bits:g}bit-scaled", _scaled(bits), palu_config(palu_bits=float(bits), **SCALED))


def relative_tier(bits: float) -> Tier:
    """``palu-<bits>bit-scaled+rel``: :func:`scaled_tier` with keys and values weighed by relative
    error at the prefill."""
    config = palu_config(palu_bits=float(bits), palu_relative_error=True, **SCALED)
    return Tier(f"palu-{bits:g}bit-scaled+rel", _relative(bits), config)


def fixed_tier(bits: float) -> Tier:
    """``palu-<bits>bit``: water-filling with fixed quantizers alone (no per-token scale, no exact
    tokens)."""
    description = (
        f"keys before RoPE where supported, {bits:g} code bit{'' if bits == 1 else 's'} per element by "
        "water-filling, fixed quantizers fitted at the prefill"
    )
    return Tier(f"palu-{bits:g}bit", description, palu_config(palu_bits=float(bits)))


def rotation_tier(bits: float) -> Tier:
    """``rotation-<bits>bit``: the rotation code (:mod:`palu_mlx.rotation_code`), nothing fitted."""
    if bits == int(bits):
        spent = f"{bits:g} bits per rotated channel"
    else:
        spent = f"{math.ceil(bits)} bits per rotated key channel and {math.floor(bits)} per value channel"
    description = (
        "nothing fitted but each head's mean: keys before RoPE where supported, a fixed Hadamard rotation "
        f"per head, {spent} under a per-token scale, the first {SINK_TOKENS} tokens exact and the "
        f"newest {RECENT_TOKENS} in int8"
    )
    # the newest tokens in int8: 2.4% fewer bytes than in 16 bits at 2,048 tokens for a KL within 1%
    # on SmolLM2 (benchmarks/results/palu_frontier.json, rotation-4bit against rotation-4bit-recent16)
    config = KVCacheConfig(
        method="rotation", palu_bits=float(bits), palu_relative_error=False, palu_recent_bits=8
    )
    return Tier(f"rotation-{bits:g}bit", description, config)


def _registry(*tiers: Tier) -> dict[str, Tier]:
    registry = {t.name: t for t in tiers}
    if len(registry) != len(tiers) or len(registry) > MAX_TIERS:
        raise KVConfigError(
            f"a tier registry holds at most {MAX_TIERS} tiers, each named once; got "
            f"{', '.join(t.name for t in tiers)}"
        )
    return registry


#: name -> :class:`Tier`, best quality first. On SmolLM2-135M at 2,048 tokens
#: (``benchmarks/results/palu_frontier.json``, ``palu_real_model.json``) the rotation tiers have
#: the lowest KL of any tier without a file from mlx-lm q4's bytes down to three quarters of them;
#: below that the fitted tiers are the only ones (``palu-2bit-scaled`` for its ``+cal`` and ``+sens``
#: twins, ``palu-1.75bit-compact`` for its ``+sens`` twin near half of q4's bytes);
#: ``reference-default`` keeps the reference description's settings under the name it documents.
TIERS: dict[str, Tier] = _registry(
    *(rotation_tier(bits) for bits in (4, 3.5, 3)),
    # spelled out, not KVCacheConfig(): the default is another tier (DEFAULT_TIER)
    relative_tier(2.25),
    relative_tier(2),
    scaled_tier(2),
    compact_tier(1.75),
    Tier(
        "reference-default",
        "the reference's settings: keys after RoPE, rank keeping 90% of singular-value energy, "
        "top 25% of latent channels at 4 bits, the rest at 2 bits",
        palu_config(palu_pre_rope=False, **REFERENCE_SPLIT),
    ),
)

#: what a calibrated twin's description adds until a file is bound (:meth:`Tier.with_calibration`)
_UNBOUND_NOTE = "; calibrated: fixed projections and quantizers from a calibration of the model"


def _calibrated_twin(base: Tier) -> Tier:
    return Tier(
        base.name + CALIBRATED_SUFFIX, base.description + _UNBOUND_NOTE, base.config, calibration="model"
    )


def _twins(
    bases: Iterable[Tier], make: Callable[[Tier], Tier], keep: Callable[[KVCacheConfig], bool]
) -> dict[str, Tier]:
    """name -> ``make(base)`` for every palu tier of ``bases`` with a bit budget whose config
    ``keep`` accepts, in its order (the rotation code fits nothing a file could fix)."""
    return {
        t.name: t
        for t in (
            make(b)
            for b in bases
            if b.config.method == "palu" and b.config.coder_bits is not None and keep(b.config)
        )
    }


def calibrated_twins(bases: Iterable[Tier]) -> dict[str, Tier]:
    """name -> ``<tier>+cal`` for every tier of ``bases`` (an iterable of :class:`Tier`) with a bit
    budget weighed by squared error (a calibration sets its own widths) and a basis and scale in
    16 bits (a calibration's are the model's: nothing of them to compact), in their order."""
    return _twins(
        bases,
        _calibrated_twin,
        lambda config: (
            not config.relative_error and (config.palu_basis_bits, config.palu_scale_bits) == (16, 16)
        ),
    )


#: name -> calibrated :class:`Tier` (``<tier>+cal``), one per tier of :data:`TIERS` that
#: :func:`calibrated_twins` takes, in its order
CALIBRATED_TIERS: dict[str, Tier] = calibrated_twins(TIERS.values())


#: what a sensitivity twin's description adds until a profile is bound (:meth:`Tier.with_calibration`)
_UNBOUND_SENSITIVITY = "; bits per layer, keys against values, from the model's sensitivity profile"


def sensitivity_twin(base: Tier) -> Tier:
    """``<tier>+sens``: ``base`` with its bits spread over the layers, and between keys and values,
    by a sensitivity profile of the model (:mod:`palu_mlx.budgets`)."""
    return Tier(
        base.name + SENSITIVITY_SUFFIX,
        base.description + _UNBOUND_SENSITIVITY,
        base.config,
        calibration="sensitivity",
    )


def sensitivity_twins(bases: Iterable[Tier]) -> dict[str, Tier]:
    """name -> ``<tier>+sens`` for every tier of ``bases`` with a bit budget and a per-token scale,
    weighed by squared error (the profile's weights are per unit of it), in their order."""
    return _twins(
        bases, sensitivity_twin, lambda config: config.palu_token_scale and not config.relative_error
    )


#: name -> :class:`Tier` whose bits are spread over the layers, and between keys and values, by a
#: sensitivity profile of the model (``<tier>+sens``; :mod:`palu_mlx.budgets`), one per tier of
#: :data:`TIERS` that :func:`sensitivity_twins` takes, in its order. Not in :data:`TIERS`: the
#: conformance suite has no model to profile.
SENSITIVITY_TIERS: dict[str, Tier] = sensitivity_twins(TIERS.values())


def tier(name: str) -> Tier:
    """The tier called ``name`` (in :data:`TIERS`, :data:`CALIBRATED_TIERS` or
    :data:`SENSITIVITY_TIERS`); raises ``KVConfigError`` (a ``ValueError``) naming the allowed names."""
    try:
        if name in TIERS:
            return TIERS[name]
        return CALIBRATED_TIERS[name] if name in CALIBRATED_TIERS else SENSITIVITY_TIERS[name]
    except (KeyError, TypeError):
        allowed = ", ".join([*TIERS, *CALIBRATED_TIERS, *SENSITIVITY_TIERS])
        raise KVConfigError(f"tier={name!r} is not a palu tier; allowed: {allowed}") from None
