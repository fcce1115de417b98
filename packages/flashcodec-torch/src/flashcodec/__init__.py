"""flashcodec: KV cache that codes the sequence axis like an image (features land in their own issue)."""

__version__ = "0.1.0"
