"""The transformers version check: the backend needs the 5.x per-layer ``Cache`` API.

transformers 4.x caches are tensors-in-lists without ``CacheLayerMixin``; subclassing them would
silently miss every hook ``generate`` calls on a layer. Fail at import instead, with the fix.
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["MIN_TRANSFORMERS", "check_layer_api", "require_layer_api"]

#: the first transformers release with ``cache_utils.CacheLayerMixin`` (the layer API)
MIN_TRANSFORMERS = "5.0"

_INSTALL_HINT = "pip install 'flashcodec-kv[hf]' (or pip install 'transformers>=5.0')"


def check_layer_api(version: str, cache_utils: ModuleType | object) -> None:
    """Raise ``ImportError`` unless ``cache_utils`` offers the 5.x layer API.

    Args:
        version: ``transformers.__version__`` (only quoted in the message).
        cache_utils: the ``transformers.cache_utils`` module (or any object standing in for it).
    """
    missing = [
        name for name in ("Cache", "CacheLayerMixin", "DynamicLayer") if not hasattr(cache_utils, name)
    ]
    if missing:
        raise ImportError(
            f"flashcodec's transformers backend needs transformers>={MIN_TRANSFORMERS} (the per-layer Cache API: "
            f"cache_utils.{', cache_utils.'.join(missing)}); found transformers {version}. {_INSTALL_HINT}"
        )


def require_layer_api() -> None:
    """Import transformers and check it (see :func:`check_layer_api`); ImportError names the version needed."""
    try:
        import transformers
        from transformers import cache_utils
    except ImportError as err:
        raise ImportError(
            f"flashcodec's transformers backend needs transformers>={MIN_TRANSFORMERS}, which is not installed: "
            f"{_INSTALL_HINT}"
        ) from err
    check_layer_api(getattr(transformers, "__version__", "unknown"), cache_utils)
