"""The ``palu-mlx`` command: ``palu-mlx compare [options]`` (see :mod:`palu_mlx.compare`).

The command needs the ``compare`` extra (kvbench); without it, it says how to install it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def _compare():
    from .compare import main

    return main


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``palu-mlx <command>``; returns the exit code (2 for an unknown command)."""
    try:
        from kvbench.cli import dispatch
    except ImportError:
        print('error: palu-mlx compare needs kvbench: pip install "palu-mlx[compare]"', file=sys.stderr)
        return 2
    return dispatch(
        "palu-mlx", {"compare": ("compare palu tiers with mlx-lm's caches on a model", _compare)}, argv
    )


if __name__ == "__main__":
    sys.exit(main())
