"""OpenBLAS for MLX on Linux, loaded in-process before MLX is imported.

MLX's Linux CPU wheel links a bundled reference BLAS: a float32 matrix product of this demo's
models runs tens of times slower through it than through an optimized one (a 1024x1024 product:
0.9 s against 0.03 s on the development machine). Its BLAS calls are resolved by name, so a BLAS
loaded first into the process's global symbol scope serves them instead, the same as
``LD_PRELOAD`` would, without the user having to set it before starting Python. torch and numpy
carry their own BLAS under private symbols and are not affected.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

__all__ = ["OPENBLAS_CANDIDATES", "use_openblas", "loaded_blas"]

#: Debian's libopenblas0-pthread, then other usual places; ``KVDEMO_BLAS`` names another file
#: (or ``none`` to keep MLX's own)
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_loaded: str | None = None


def use_openblas() -> str | None:
    """Load OpenBLAS globally so MLX, imported after this, multiplies through it. Returns the file
    loaded, or None: not Linux, none installed, ``KVDEMO_BLAS=none``, or MLX already imported
    (its symbols are bound by then, so loading now would change nothing)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if sys.platform != "linux" or "mlx.core" in sys.modules:
        return None
    chosen = os.environ.get("KVDEMO_BLAS", "").strip()
    if chosen.lower() == "none":
        return None
    for path in (chosen,) if chosen else OPENBLAS_CANDIDATES:
        if Path(path).is_file():
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _loaded = path
            return path
    return None


def loaded_blas() -> str | None:
    """The BLAS :func:`use_openblas` loaded (also one given through ``LD_PRELOAD``), else None."""
    if _loaded is not None:
        return _loaded
    preload = os.environ.get("LD_PRELOAD", "")
    return next((p for p in preload.replace(":", " ").split() if "blas" in Path(p).name), None)
