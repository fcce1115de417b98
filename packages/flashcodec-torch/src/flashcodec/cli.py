"""The ``flashcodec`` command: ``flashcodec compare [options]`` (see :mod:`flashcodec.compare`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

_USAGE = """usage: flashcodec <command> [options]

commands:
  compare   compare flashcodec tiers with transformers' caches on a model (flashcodec compare --help)
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``flashcodec <command>``; returns the exit code (2 for an unknown command)."""
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
