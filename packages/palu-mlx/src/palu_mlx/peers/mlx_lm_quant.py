"""mlx-lm's own ``QuantizedKVCache`` (affine, per token in groups of channels, no residual window)."""

from __future__ import annotations

from typing import Any

from . import Peer, PeerUnavailable, plain_layers

#: peer name -> bits of mlx-lm's QuantizedKVCache
PEER_BITS: dict[str, int] = {"mlx-lm-q8": 8, "mlx-lm-q4": 4}


def group_size(model: Any) -> int:
    """64, or 32 for head dims 64 does not divide (mlx.core.quantize takes 32, 64 or 128)."""
    from ..builder import model_kv_dims

    head_dim, _ = model_kv_dims(model)
    if head_dim is None:
        raise PeerUnavailable("cannot read the head dim from the model's args")
    if head_dim % 32:
        raise PeerUnavailable(f"head dim {head_dim} is not a multiple of 32 (mlx.core.quantize groups)")
    return 64 if head_dim % 64 == 0 else 32


def _peer(name: str, bits: int) -> Peer:
    def make(model: Any) -> list[Any]:
        from mlx_lm.models.cache import QuantizedKVCache

        group = group_size(model)
        return plain_layers(model, lambda: QuantizedKVCache(group_size=group, bits=bits))

    return Peer(
        name,
        f"mlx-lm QuantizedKVCache, {bits}-bit",
        make,
        {"class": "mlx_lm.models.cache.QuantizedKVCache", "bits": bits},
        sized=lambda model: {"group_size": group_size(model)},
    )


PEERS = [_peer(name, bits) for name, bits in PEER_BITS.items()]
