"""The ``palu-mlx`` command: ``palu-mlx compare [options]`` (see :mod:`palu_mlx.compare`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

_USAGE = """usage: palu-mlx <command> [options]

commands:
  compare   compare palu tiers with mlx-lm's caches on a model (palu-mlx compare --help)
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``palu-mlx <command>``; returns the exit code (2 for an unknown command)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "compare":
        from .compare import main as compare_main

        return compare_main(rest)
    print(f"error: unknown command {command!r}; allowed: compare", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
