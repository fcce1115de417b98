"""kvspec: the contract every KV-cache package in this monorepo meets (numpy only)."""

from .adapter import Adapter, CacheConfigCase, Capabilities
from .interface import (
    KVCacheLayer,
    KVConfigError,
    KVDtypeError,
    KVShapeError,
    KVSpecError,
    KVTrimError,
    KVValueError,
    StorageStats,
    check_kv_pair,
)

__version__ = "0.1.0"

__all__ = [
    "Adapter",
    "CacheConfigCase",
    "Capabilities",
    "KVCacheLayer",
    "KVConfigError",
    "KVDtypeError",
    "KVShapeError",
    "KVSpecError",
    "KVTrimError",
    "KVValueError",
    "StorageStats",
    "check_kv_pair",
]
