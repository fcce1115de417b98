"""How palu codes latent channels: the coder a config chooses and the per-tensor coders it fits.

* :class:`Rotation` (the default): nothing fitted, a fixed rotation and ``bits`` per rotated channel
  (:mod:`palu_mlx.rotation_code`); :class:`NaiveQuant`, the naive baseline;
* :class:`WaterFilling` (``palu_bits``; the fitted cache's default): a bit budget, water-filled widths, fixed
  Gaussian-step quantizers (:class:`FixedQuantCoder`), optionally a per-token scale;
* :class:`HiLoSplit` (the reference's settings): a rank, the top channels at ``hi_bit`` and the rest
  at ``lo_bit``, per-group scale and bias (:class:`~palu_mlx.mixed_bit.MixedBitCoder`);
* :class:`LatentCoder`: what a cache asks of a per-tensor coder, and :class:`FitSettings`, what a
  coder choice's ``fit(keys, values, settings)`` is told besides the tokens
  (:mod:`palu_mlx.coders.base`).
"""

from .base import FitSettings, LatentCoder
from .fixed import GAUSSIAN_STEP, TOKEN_SCALE_BYTES, FixedQuantCoder, token_scales
from .hilo import HiLoSplit
from .naive import NaiveQuant
from .rotation import Rotation
from .water_filling import DEFAULT_PALU_BITS, WaterFilling

__all__ = [
    "Rotation",
    "NaiveQuant",
    "HiLoSplit",
    "WaterFilling",
    "LatentCoder",
    "FitSettings",
    "FixedQuantCoder",
    "GAUSSIAN_STEP",
    "TOKEN_SCALE_BYTES",
    "DEFAULT_PALU_BITS",
    "token_scales",
]
