"""palu-mlx: low-rank latent KV cache for mlx-lm (features land in their own issue)."""

__version__ = "0.1.0"
