"""VeloxQuant-MLX's caches (PyPI ``veloxquant-mlx``, optional: ``pip install "palu-mlx[peers]"``),
built through its own ``KVCacheBuilder.for_model(model, KVCacheConfig(method=..., ...))``.

Several of these caches quantize and immediately de-quantize into 16-bit buffers, and their
``nbytes`` / ``compressed_*_bytes`` are the package's own accounting of what packed storage
would cost. The rows therefore count the bytes of every array the caches keep
(:class:`~palu_mlx.peers.PeerCaches`), and report the package's accounting beside it
(``details.accounted_bits``): its claim, next to what is resident here.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from . import Peer, PeerCaches, PeerUnavailable

INSTALL = 'pip install "palu-mlx[peers]"'
#: the release these peers were written against
VERSION = "0.94.15"


def _velox() -> tuple[Any, Any]:
    try:
        base = importlib.import_module("veloxquant_mlx.cache.base")
    except ImportError as err:
        raise PeerUnavailable(
            f"veloxquant-mlx is not installed ({INSTALL}): {type(err).__name__}: {err}"
        ) from None
    return base.KVCacheBuilder, base.KVCacheConfig


def _options(kind: str, values: dict[str, Any]) -> Any:
    return getattr(importlib.import_module("veloxquant_mlx.cache.options"), kind)(**values)


def _own_bytes(cache: Any) -> tuple[int, str] | None:
    """What the cache itself says it stores, and where that figure comes from."""
    from mlx_lm.models.cache import KVCache

    if hasattr(cache, "compressed_key_bytes"):
        own_nbytes = getattr(type(cache), "nbytes", None)
        if own_nbytes is not None and own_nbytes is not KVCache.nbytes:
            return int(cache.nbytes), "nbytes"
        total = int(cache.compressed_key_bytes)
        source = "compressed_key_bytes"
        if hasattr(cache, "compressed_value_bytes"):
            total += int(cache.compressed_value_bytes)
            source += " + compressed_value_bytes"
        if hasattr(cache, "residual_fp16_bytes"):
            total += int(cache.residual_fp16_bytes)
            source += " + residual_fp16_bytes"
        return total, source
    return None


def accounted(model: Any, caches: list[Any]) -> dict[str, Any]:
    """The package's own bytes for the caches of a run, as bits per cached K/V element (batch 1:
    2 x KV heads x head dim x the tokens each cache says it holds)."""
    from ..builder import model_kv_dims

    head_dim, n_kv = model_kv_dims(model)
    total, elements, sources = 0, 0, set()
    for cache in caches:
        own = _own_bytes(cache)
        if own is None:
            continue
        total += own[0]
        sources.add(own[1])
        elements += 2 * int(n_kv or 0) * int(head_dim or 0) * int(getattr(cache, "offset", 0) or 0)
    out: dict[str, Any] = {"accounted_bytes": total, "accounted_from": sorted(sources)}
    out["accounted_bits"] = 8 * total / elements if elements else None
    return out


def _peer(name: str, method: str, description: str, **config: Any) -> Peer:
    options = config.pop("options", None)
    record = {"package": f"veloxquant-mlx {VERSION}", "method": method, **config}
    if options is not None:
        record["options"] = {"class": options[0], **options[1]}

    def make(model: Any) -> list[Any]:
        from ..builder import model_kv_dims

        builder, config_class = _velox()
        head_dim, _ = model_kv_dims(model)
        if head_dim is None:
            raise PeerUnavailable("cannot read the head dim from the model's args")
        kwargs = dict(config)
        if options is not None:
            kwargs["options"] = _options(*options)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its deprecation notes would interleave the progress
                caches = builder.for_model(model, config_class(method=method, head_dim=head_dim, **kwargs))
        except Exception as err:  # the package's QuantizerConfigError and the like: the model does not suit
            raise PeerUnavailable(f"veloxquant-mlx refuses the model: {type(err).__name__}: {err}") from None
        return PeerCaches(caches)

    return Peer(name, f"VeloxQuant-MLX {method}: {description}", make, record, accounted=accounted)


PEERS = [
    _peer("velox-kivi-4", "kivi", "KIVI, 4-bit, group 32, fp16 residual 128", bit_width_inlier=4),
    _peer("velox-kivi-2", "kivi", "KIVI, 2-bit, group 32, fp16 residual 128", bit_width_inlier=2),
    _peer(
        "velox-kivi_sink-2",
        "kivi_sink",
        "KIVI 2-bit with high-norm sink tokens kept fp16",
        bit_width_inlier=2,
    ),
    _peer(
        "velox-gear-4",
        "gear",
        "GEAR, 4-bit base + low-rank + sparse residual",
        options=("GEAROptions", {"gear_bits": 4}),
    ),
    _peer("velox-kvtc", "kvtc", "KVTC, transform coding with entropy coding (its defaults)"),
    _peer("velox-turboquant_rvq-2", "turboquant_rvq", "TurboQuant RVQ keys, 2-bit", bit_width_inlier=2),
    _peer(
        "velox-kvquant-3",
        "kvquant",
        "KVQuant non-uniform 3-bit",
        options=("KVQuantOptions", {"kvquant_bits": 3}),
    ),
    _peer("velox-palu", "palu", "PALU low-rank latents, mixed 4/2-bit (its defaults)"),
]
