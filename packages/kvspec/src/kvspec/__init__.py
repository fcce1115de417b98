"""kvspec: the contract every KV-cache package in this monorepo meets (numpy only).

* :mod:`kvspec.interface`: the ``KVCacheLayer`` protocol, error classes, ``StorageStats``.
* :mod:`kvspec.adapter`: what a package provides so the conformance checks can drive it.
* :mod:`kvspec.vectors` / :mod:`kvspec.synthetic`: shipped test vectors and their generators.
* :mod:`kvspec.conformance`: the checks, as plain functions over an adapter.
* :mod:`kvspec.reference`: an uncompressed numpy cache meeting the whole contract.
"""

from .adapter import Adapter, CacheConfigCase, Capabilities
from .interface import (
    KVCacheLayer,
    KVConfigError,
    KVDataError,
    KVDtypeError,
    KVShapeError,
    KVSpecError,
    KVTrimError,
    KVValueError,
    StorageStats,
    check_kv_pair,
    trim_count,
)
from .reference import NumpyReferenceCache, ReferenceAdapter
from .vectors import TestVector, add_vectors, get_vector, load_vectors

__version__ = "0.1.0"

_LAZY = {"CHECKS", "ConformanceError", "conformance_items"}


def __getattr__(name: str):
    # imported on first use, so `python -m kvspec.conformance` does not find itself pre-imported
    if name in _LAZY:
        from . import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module 'kvspec' has no attribute {name!r}")


__all__ = [
    "Adapter",
    "CHECKS",
    "CacheConfigCase",
    "Capabilities",
    "ConformanceError",
    "KVCacheLayer",
    "KVConfigError",
    "KVDataError",
    "KVDtypeError",
    "KVShapeError",
    "KVSpecError",
    "KVTrimError",
    "KVValueError",
    "NumpyReferenceCache",
    "ReferenceAdapter",
    "StorageStats",
    "TestVector",
    "add_vectors",
    "check_kv_pair",
    "conformance_items",
    "get_vector",
    "load_vectors",
    "trim_count",
]
