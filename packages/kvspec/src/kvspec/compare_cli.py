"""What both compare command lines share: the same options, inputs and one-line errors.

:func:`add_common_arguments`, :func:`load_eval_text`, :func:`load_prompts` and :func:`run_cli`
give ``palu-mlx compare`` and ``flashcodec compare`` the same options and the same one-line
errors (:class:`OneLineParser`, :class:`~kvspec.results.CompareError`).

Beyond the standard library it imports only :mod:`kvspec.measure` and :mod:`kvspec.results`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from .interface import KVSpecError
from .measure import Settings, text_windows
from .results import CompareError

__all__ = [
    "OneLineParser",
    "add_common_arguments",
    "parse_selection",
    "load_eval_text",
    "load_prompts",
    "default_text_path",
    "prepare_tokens",
    "check_positions",
    "run_cli",
    "dispatch",
]


HELDOUT_RELATIVE_PATH = Path("benchmarks") / "data" / "heldout.txt"


def default_text_path(cwd: Path | None = None) -> Path | None:
    """The repository's held-out text (``benchmarks/data/heldout.txt``) above ``cwd`` or this
    package, or None outside a checkout."""
    for start in (Path(cwd) if cwd is not None else Path.cwd(), Path(__file__).resolve().parent):
        for directory in (start.resolve(), *start.resolve().parents):
            candidate = directory / HELDOUT_RELATIVE_PATH
            if candidate.is_file():
                return candidate
    return None


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``error: ...``, exit code 2), like every
    other mistake the compare commands report."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def add_common_arguments(parser: argparse.ArgumentParser, tiers: Sequence[str], peers: Sequence[str]) -> None:
    """The options both compare commands share (model, text, prompts, selection, sizes, outputs)."""
    parser.add_argument(
        "--model",
        help="a local model directory or, with network access, a Hugging Face hub id "
        "(default: the repository's embedded tiny model)",
    )
    parser.add_argument(
        "--text",
        help="held-out text file for perplexity and default prompts (default: the repository's "
        f"{HELDOUT_RELATIVE_PATH.as_posix()})",
    )
    parser.add_argument(
        "--prompt", action="append", default=None, help="a prompt for greedy generation (repeatable)"
    )
    parser.add_argument("--prompts", help="file of prompts for greedy generation, one per non-empty line")
    parser.add_argument(
        "--tiers", help=f"comma-separated tiers (default: all): {', '.join(tiers)}; 'none' for no tier"
    )
    parser.add_argument(
        "--peers",
        help=f"comma-separated peer caches (default: all): {', '.join(peers)}; 'none' for no peer. "
        "A peer whose package is not installed is reported as absent, with the error",
    )
    parser.add_argument("--windows", type=int, default=Settings.windows, help="held-out windows (default 4)")
    parser.add_argument(
        "--context-tokens",
        type=int,
        default=Settings.context_tokens,
        help="prefilled tokens per window (default 192)",
    )
    parser.add_argument(
        "--scored-tokens",
        type=int,
        default=Settings.scored_tokens,
        help="teacher-forced, scored tokens per window after the context (default 64)",
    )
    parser.add_argument(
        "--new-tokens", type=int, default=Settings.new_tokens, help="greedy tokens per prompt (default 32)"
    )
    parser.add_argument(
        "--prompt-count",
        type=int,
        default=Settings.prompt_count,
        help="without --prompt/--prompts: greedy prompts taken from the first windows' contexts (default 2)",
    )
    parser.add_argument(
        "--speed-rounds",
        type=int,
        default=Settings.speed_rounds,
        help="round-robin timing rounds (default 3)",
    )
    parser.add_argument(
        "--speed-steps",
        type=int,
        default=Settings.speed_steps,
        help="timed one-token calls per round (default 16)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full result as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib)")
    parser.add_argument("--list", action="store_true", help="list the tiers and peers, then exit")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_selection(value: str | None, allowed: Sequence[str], option: str) -> list[str]:
    """Names chosen with ``--tiers`` / ``--peers`` (None: all; "none": none), in ``allowed`` order."""
    if value is None:
        return list(allowed)
    names = [v.strip() for v in value.split(",") if v.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise CompareError(
            f"{option}={value!r}: unknown name {', '.join(map(repr, unknown)) or '(empty)'}; "
            f"allowed: {', '.join(allowed)} or none"
        )
    return [n for n in allowed if n in names]


def load_eval_text(path: str | None) -> tuple[str, Path]:
    """The held-out text and where it came from (``--text`` or the repository default)."""
    if path is None:
        found = default_text_path()
        if found is None:
            raise CompareError(
                f"no evaluation text: pass --text FILE (the repository's {HELDOUT_RELATIVE_PATH.as_posix()} "
                "was not found above the working directory)"
            )
        file = found
    else:
        file = Path(path).expanduser()
        if not file.is_file():
            raise CompareError(f"--text {path!r}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CompareError(f"--text {str(file)!r} is not UTF-8 text") from None
    if not text.strip():
        raise CompareError(f"--text {str(file)!r} is empty")
    return text, file


def load_prompts(prompt: Sequence[str] | None, prompts_file: str | None) -> list[str] | None:
    """Prompts from ``--prompt`` (repeated) and ``--prompts FILE``; None when neither was given."""
    out = [p for p in (prompt or []) if p.strip()]
    if prompt and not out:
        raise CompareError("--prompt: every prompt given is empty")
    if prompts_file is not None:
        file = Path(prompts_file).expanduser()
        if not file.is_file():
            raise CompareError(f"--prompts {prompts_file!r}: no such file")
        lines = [ln for ln in file.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if not lines:
            raise CompareError(f"--prompts {prompts_file!r} has no non-empty line")
        out += lines
    return out or None


def prepare_tokens(
    encode_text: Callable[[str], list[int]],
    encode_prompt: Callable[[str], list[int]],
    text: str,
    prompt_texts: Sequence[str] | None,
    settings: Settings,
) -> tuple[list[list[int]], list[list[int]], str]:
    """``(windows, prompts, prompt_source)``: held-out windows of ``text`` and the greedy prompts
    (``prompt_texts`` encoded, or, when None, the context of each window)."""
    windows = text_windows(encode_text(text), settings)
    if prompt_texts is None:
        contexts = [w[: settings.context_tokens] for w in windows[: settings.prompt_count]]
        return windows, contexts, f"the context of the first {len(contexts)} windows"
    return windows, [encode_prompt(p) for p in prompt_texts], "--prompt / --prompts"


def check_positions(limit: int | None, settings: Settings, prompts: Sequence[Sequence[int]]) -> None:
    """CompareError when a window or a prompt plus its greedy tokens exceeds the model's ``limit``."""
    longest = max(settings.window_tokens, max(len(p) for p in prompts) + settings.new_tokens)
    if limit and longest > limit:
        raise CompareError(
            f"the run needs {longest} positions but the model allows {limit}: "
            "shorten --context-tokens / --scored-tokens / --new-tokens or the prompts"
        )


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Call ``main(argv)``; a kvspec error (a mistake the user can fix) prints one line
    ``error: ...`` to stderr and returns 2 instead of a traceback."""
    try:
        return main(argv)
    except KVSpecError as err:
        message = " ".join(str(err).split())
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except SystemExit as done:  # argparse: --help (0) or a bad option (2, already printed)
        return done.code if isinstance(done.code, int) else int(done.code is not None)


def dispatch(
    program: str,
    commands: dict[str, tuple[str, Callable[[], Callable[[list[str]], int]]]],
    argv: Sequence[str] | None = None,
) -> int:
    """Run ``<program> <command> [options]``: the package CLIs' shared sub-command dispatch.

    ``commands`` maps a command name to ``(one-line help, loader)``; the loader imports and
    returns the command's ``main`` only when chosen (so ``--help`` imports no framework).
    Returns the exit code: 0 for ``--help``, 2 for no or an unknown command.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        lines = [f"usage: {program} <command> [options]", "", "commands:"]
        lines += [f"  {name:9s} {text} ({program} {name} --help)" for name, (text, _) in commands.items()]
        print("\n".join(lines))
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in commands:
        print(f"error: unknown command {command!r}; allowed: {', '.join(commands)}", file=sys.stderr)
        return 2
    return commands[command][1]()(rest)
