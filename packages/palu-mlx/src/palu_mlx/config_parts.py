"""The small objects a :class:`~palu_mlx.config.KVCacheConfig` is made of, besides its coder.

Each groups the settings of one concern, so a config reads as a few choices instead of a flat list:
:class:`Fitting` (where the basis comes from and its shape), :class:`ExactTokens` (which tokens are
held beside their codes) and :class:`SideInformation` (how the basis, scales and groups are stored).
They hold values only; :class:`~palu_mlx.config.KVCacheConfig` checks them, in the words of the
``palu_*`` keywords a user types, when a config is made.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fitting", "ExactTokens", "SideInformation", "DEFAULT_SINK_TOKENS", "DEFAULT_RECENT_TOKENS"]

#: tokens at the start of a sequence a config holds exactly unless it says otherwise
#: (``palu_sink_tokens``): real models' attention sinks sit on the first token or few
DEFAULT_SINK_TOKENS = 4
#: the newest tokens a config holds beside their codes unless it says otherwise (``palu_recent_tokens``)
DEFAULT_RECENT_TOKENS = 32


@dataclass(frozen=True)
class Fitting:
    """Where the latent basis comes from and its shape (the fitted ``"palu"`` method only).

    Attributes:
        rank: latent rank (``palu_rank``); None: full rank for the bit budget, the energy rule for
            the hi/lo split.
        energy_threshold: share of singular-value energy the hi/lo split keeps when ``rank`` is None
            (``palu_energy_threshold``; None: 0.90).
        n_head_groups: KV heads sharing one projection, as a count of groups (``palu_n_head_groups``;
            None: one per KV head).
        min_fit_tokens: tokens held exactly before the fit (``palu_min_fit_tokens``; None: the head dim).
        calibration: a ``palu-mlx calibrate`` file: fixed projections and quantizers (``palu_calibration``).
        sensitivity: a sensitivity profile spreading the bits over layers (``palu_sensitivity``).
    """

    rank: int | None = None
    energy_threshold: float | None = None
    n_head_groups: int | None = None
    min_fit_tokens: int | None = None
    calibration: str | None = None
    sensitivity: str | None = None


@dataclass(frozen=True)
class ExactTokens:
    """Tokens attention reads beside (instead of) their codes.

    Attributes:
        sink: the first tokens of a sequence, kept in the input dtype (``palu_sink_tokens``): real
            models send a large share of attention to the first token or few.
        recent: the newest tokens (``palu_recent_tokens``), each coded when newer ones push it out.
        recent_bits: 16 keeps the newest tokens as given, 8 as int8 with a scale per token and head
            (``palu_recent_bits``).
    """

    sink: int = DEFAULT_SINK_TOKENS
    recent: int = DEFAULT_RECENT_TOKENS
    recent_bits: int = 16


@dataclass(frozen=True)
class SideInformation:
    """How what sits beside the codes is stored.

    Attributes:
        group_size: channels sharing one scale and bias in the hi/lo split's segments (``palu_group_size``).
        basis_bits: 16, or 8 for a prefill-fitted basis as int8 codes per column (``palu_basis_bits``).
        scale_bits: 16, or 8 for the per-token scale as a one-byte log code (``palu_scale_bits``).
        fill_rows: give the bits that round each row of codes up to whole bytes to its channels
            (``palu_fill_rows``).
    """

    group_size: int = 32
    basis_bits: int = 16
    scale_bits: int = 16
    fill_rows: bool = False
