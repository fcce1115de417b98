"""The ``flashcodec`` command: ``flashcodec compare [options]`` (see :mod:`flashcodec.compare`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvspec.compare_cli import dispatch

__all__ = ["main"]


def _compare():
    from .compare import main

    return main


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``flashcodec <command>``; returns the exit code (2 for an unknown command)."""
    return dispatch(
        "flashcodec",
        {"compare": ("compare flashcodec tiers with transformers' caches on a model", _compare)},
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
