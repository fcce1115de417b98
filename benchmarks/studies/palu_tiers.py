"""palu configurations measured by studies, outside the package's registry.

:data:`palu_mlx.tiers.TIERS` holds the tiers a user should pick from (at most eight). The
configurations here lost to one of them on the real model (``benchmarks/results/palu_frontier.json``,
``palu_real_model.json``), or are reference points and steps towards them; the benchmark scripts
that measured them (``benchmarks/palu/*.py``) look their names up through :func:`tier`, so their
results files can be reproduced under the names they recorded. Each is a
:class:`palu_mlx.tiers.Tier` made by the registry's own builders, so a name here means the
configuration it meant when it was measured.

    import sys; sys.path.insert(0, "benchmarks")
    from studies.palu_tiers import tier, tier_config

Run as a script it is ``palu-mlx compare`` offering these configurations beside the package's:

    hatch run bench:python benchmarks/studies/palu_tiers.py --tiers palu-2bit,palu-1bit --peers mlx-lm-q4
"""

from __future__ import annotations

import sys

from palu_mlx.compare import main as compare_main
from palu_mlx.config import KVCacheConfig
from palu_mlx.tiers import (
    CALIBRATED_TIERS,
    SENSITIVITY_TIERS,
    TIERS,
    UNQUANTIZED,
    Tier,
    calibrated_twins,
    compact_tier,
    fixed_tier,
    palu_config,
    relative_tier,
    scaled_tier,
    sensitivity_twin,
    sensitivity_twins,
)
from palu_mlx.tiers import tier as registry_tier

__all__ = [
    "STUDY_TIERS",
    "STUDY_CALIBRATED_TIERS",
    "STUDY_SENSITIVITY_TIERS",
    "ALL_TIERS",
    "tier",
    "tier_config",
]

#: name -> :class:`Tier` of every study configuration that needs no file, easiest first
STUDY_TIERS: dict[str, Tier] = {
    t.name: t
    for t in (
        # reference points: the change of basis alone, then low rank alone, then low rank in 4 bits
        Tier(
            "full-rank-fp16",
            "full rank (64 of a 64-dim head), latents unquantized: the change of basis alone",
            palu_config(palu_rank=64, **UNQUANTIZED),
            full_rank=True,
        ),
        Tier(
            "r16-fp16",
            "rank 16, latents unquantized: low-rank error only",
            palu_config(palu_rank=16, **UNQUANTIZED),
        ),
        Tier(
            "r8-4bit",
            "rank 8, every latent channel at 4 bits",
            palu_config(palu_rank=8, palu_hi_bit=4, palu_lo_bit=4),
        ),
        # the scaled coder weighed by squared error, above the registry's 2 bits
        *(scaled_tier(bits) for bits in (3, 2.5)),
        # the compact coder with each row's padding bits spent on its channels
        compact_tier(1.7, fill=True),
        # relative-error budgets the rotation tiers beat at their bytes
        *(relative_tier(bits) for bits in (3.25, 3, 2.5)),
        # fixed quantizers without a per-token scale or exact tokens: they lose to mlx-lm q4 at
        # every budget on a real model
        *(fixed_tier(bits) for bits in (3, 2, 1.5, 1.25, 1)),
    )
}

#: name -> ``<study tier>+cal``, the calibrated twins :func:`palu_mlx.tiers.calibrated_twins` makes
STUDY_CALIBRATED_TIERS: dict[str, Tier] = calibrated_twins(STUDY_TIERS.values())

#: name -> ``<study tier>+sens``, and one with no twin anywhere: the smallest budget whose KL is at
#: most mlx-lm q4's on SmolLM2-135M before the compact side information
STUDY_SENSITIVITY_TIERS: dict[str, Tier] = {
    **sensitivity_twins(STUDY_TIERS.values()),
    "palu-1.75bit-scaled+sens": sensitivity_twin(scaled_tier(1.75)),
}

#: every name a benchmark may ask for: the package's registries, then the studies'
ALL_TIERS: dict[str, Tier] = {
    **TIERS,
    **CALIBRATED_TIERS,
    **SENSITIVITY_TIERS,
    **STUDY_TIERS,
    **STUDY_CALIBRATED_TIERS,
    **STUDY_SENSITIVITY_TIERS,
}

_DEFINED = (
    TIERS,
    CALIBRATED_TIERS,
    SENSITIVITY_TIERS,
    STUDY_TIERS,
    STUDY_CALIBRATED_TIERS,
    STUDY_SENSITIVITY_TIERS,
)
if len(ALL_TIERS) != sum(map(len, _DEFINED)):  # a study must never shadow a tier a user can pick
    raise RuntimeError("a palu study configuration reuses a name already defined")


def tier(name: str) -> Tier:
    """The tier called ``name``: :func:`palu_mlx.tiers.tier` for the package's registries, else the
    study configuration. Raises ``KVConfigError`` naming every allowed name."""
    if isinstance(name, str) and name in ALL_TIERS:
        return ALL_TIERS[name]
    studies = ", ".join([*STUDY_TIERS, *STUDY_CALIBRATED_TIERS, *STUDY_SENSITIVITY_TIERS])
    try:
        return registry_tier(name)  # raises, naming the registry's tiers
    except ValueError as err:
        raise type(err)(f"{err}; or a study configuration: {studies}") from None


def tier_config(name: str, head_dim: int, calibration: str | None = None) -> KVCacheConfig:
    """The config of tier ``name`` (:func:`tier`) for a model with key head dim ``head_dim``, bound
    to ``calibration`` where it needs one (:meth:`palu_mlx.tiers.Tier.sized`)."""
    return tier(name).sized(head_dim, calibration)


if __name__ == "__main__":
    sys.exit(compare_main(sys.argv[1:], registry=ALL_TIERS))
