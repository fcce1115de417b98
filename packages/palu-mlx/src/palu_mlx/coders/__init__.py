"""How palu codes latent channels into bytes."""

from .fixed import GAUSSIAN_STEP, TOKEN_SCALE_BYTES, FixedQuantCoder, token_scales

__all__ = ["GAUSSIAN_STEP", "TOKEN_SCALE_BYTES", "FixedQuantCoder", "token_scales"]
