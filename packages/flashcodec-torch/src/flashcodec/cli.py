"""The ``flashcodec`` command: ``flashcodec compare [options]`` (see :mod:`flashcodec.compare`).

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
    """Dispatch ``flashcodec <command>``; returns the exit code (2 for an unknown command)."""
    try:
        from kvbench.cli import dispatch
    except ImportError:
        print(
            'error: flashcodec compare needs kvbench: pip install "flashcodec-kv[compare]"', file=sys.stderr
        )
        return 2
    return dispatch(
        "flashcodec",
        {"compare": ("compare flashcodec tiers with transformers' caches on a model", _compare)},
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
