"""The ``palu-mlx`` command.

* ``palu-mlx calibrate --model PATH_OR_ID --out FILE [--text FILE] [--max-tokens N|all]
  [--weighting attention|none] [--dtype auto|float32|model]``: fit per-layer, per-KV-head
  projections on calibration text (:mod:`palu_mlx.calibration`); needs only palu-mlx.
* ``palu-mlx sensitivity --model PATH_OR_ID [--out FILE] [--text FILE] [--bits B] [--context N]
  [--scored N] [--windows N] [--dtype auto|float32|model]``: measure the model's per-layer
  sensitivity to palu's coding, keys against values (:func:`palu_mlx.budgets.measure_sensitivity`),
  and write the profile the ``+sens`` budgets read (``palu_sensitivity=``), by default beside the
  model directory (:func:`palu_mlx.budgets.profile_path`); needs only palu-mlx.
* ``palu-mlx generate [mlx_lm.generate's options] [--palu-bits B | --palu-tier NAME]
  [--calibration FILE]`` (:mod:`palu_mlx.generate`): mlx-lm's generate with palu's cache.
* ``palu-mlx server [mlx_lm.server's options] [palu's options]`` (:mod:`palu_mlx.server`):
  mlx-lm's OpenAI-compatible server with palu's cache.
* ``palu-mlx compare [options]`` (see :mod:`palu_mlx.compare`): needs the ``compare`` extra
  (kvbench); without it, it says how to install it.

``--model`` of calibrate, sensitivity, generate and server also takes kvbench's named models
(``smollm2-135m``, ``tiny-qwen3``) when kvbench is installed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "calibrate_main", "sensitivity_main"]

_CALIBRATE_HELP = "fit per-layer, per-KV-head projections for a model on calibration text"
_GENERATE_HELP = "generate text with mlx-lm and palu's KV cache (mlx_lm.generate's options)"
_SENSITIVITY_HELP = (
    "measure a model's per-layer sensitivity to palu's coding, keys against values, for the +sens budgets"
)
_SERVER_HELP = "mlx-lm's OpenAI-compatible server with palu's KV cache (mlx_lm.server's options)"

# Debian / Ubuntu's OpenBLAS (libopenblas0-pthread), whose libblas.so.3 mlx's Linux CPU wheel can be
# pointed at with LD_PRELOAD: its float32 matmuls are many times faster than the bundled reference BLAS
_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def _max_tokens(value: str) -> int | None:
    if value == "all":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a number of tokens nor 'all'") from None


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return number


def _bit_budget(value: str) -> float:
    from .coders.water_filling import is_bit_budget

    try:
        bits = float(value)
    except ValueError:
        bits = float("nan")
    if not is_bit_budget(bits):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of code bits per element in (0, 8]")
    return bits


def _blas_hint(model) -> str | None:
    """A one-line note when a 16-bit model is about to run in 16 bits on a Linux CPU where float32 could be fast."""
    import os

    import mlx.core as mx

    from .calibration.fit import _is_quantized, _model_dtype

    if not sys.platform.startswith("linux") or mx.default_device() != mx.cpu:
        return None
    if _model_dtype(model) not in (mx.bfloat16, mx.float16) or _is_quantized(model):
        return None
    if "blas" in os.environ.get("LD_PRELOAD", "") or not os.path.exists(_OPENBLAS):
        return None
    return (
        "note: float32 is slow with mlx's bundled BLAS, so calibration runs in the model's 16-bit dtype; "
        f"with LD_PRELOAD={_OPENBLAS} it runs in float32, several times faster"
    )


class _UserMistake(Exception):
    """A mistake in a command's options: reported as ``error: <message>``, exit code 1."""


def _reporting_mistakes(command, argv: Sequence[str]) -> int:
    """``command(argv)``'s exit code, or 1 after printing its :class:`_UserMistake` as one line."""
    try:
        return command(argv)
    except _UserMistake as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _model_command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser for a command that runs a model, with its required ``--model``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--model",
        required=True,
        help="mlx-lm model: a local path, a Hugging Face id, or a named model (smollm2-135m, tiny-qwen3; needs kvbench)",
    )
    return parser


def _add_run_options(parser: argparse.ArgumentParser, dtype_help: str) -> None:
    """``--dtype`` (auto, float32, model) and ``--quiet``, as calibrate and sensitivity take them."""
    from .calibration import COMPUTE_DTYPES

    parser.add_argument("--dtype", default="auto", choices=COMPUTE_DTYPES, help=dtype_help)
    parser.add_argument("--quiet", action="store_true", help="no progress bar (and no note on the BLAS)")


def _model_path(name: str, quiet: bool) -> str:
    """What ``--model`` names: a local directory, a hub id, or a named model's directory."""
    from .serving import ModelNameError, resolve_model_arg

    try:
        return resolve_model_arg(name, quiet=quiet)
    except ModelNameError as exc:
        raise _UserMistake(str(exc)) from None


def _read_text(path: str | None) -> str | None:
    """``--text``'s contents (None without it)."""
    try:
        return None if path is None else open(path, encoding="utf-8").read()
    except OSError as exc:
        raise _UserMistake(f"--text {path!r} cannot be read: {exc}") from None


def _load_model(model_path: str, name: str):
    """``mlx_lm.load`` of ``--model``: ``(model, tokenizer)``."""
    import mlx_lm

    try:
        return mlx_lm.load(model_path)
    except Exception as exc:  # noqa: BLE001 - any loading failure is the user's --model
        raise _UserMistake(f"--model {name!r} cannot be loaded: {exc}") from None


def calibrate_main(argv: Sequence[str]) -> int:
    """``palu-mlx calibrate``: returns the exit code (1 with a one-line error on a user mistake)."""
    return _reporting_mistakes(_calibrate_command, argv)


def _calibrate_command(argv: Sequence[str]) -> int:
    from .calibration import DEFAULT_MAX_TOKENS, WEIGHTINGS

    parser = _model_command_parser("palu-mlx calibrate", _CALIBRATE_HELP)
    parser.add_argument("--out", required=True, help="calibration file to write (.safetensors)")
    parser.add_argument(
        "--text",
        default=None,
        help="UTF-8 text file to calibrate on (default: the text shipped with palu-mlx)",
    )
    parser.add_argument("--window", type=int, default=512, help="tokens per calibration window (default 512)")
    parser.add_argument(
        "--max-tokens",
        type=_max_tokens,
        default=DEFAULT_MAX_TOKENS,
        metavar="N|all",
        help=f"use at most this many tokens, or 'all' (default {DEFAULT_MAX_TOKENS}: past it the fit barely "
        "changes; see docs/palu-mlx.md)",
    )
    parser.add_argument(
        "--weighting",
        default="attention",
        choices=WEIGHTINGS,
        help="attention (default): key errors weighed by how the queries probe them, value errors by how "
        "o_proj sees them; none: plain squared error (the transform is the covariance's eigenbasis). "
        "Recorded in the file",
    )
    _add_run_options(
        parser,
        "what the forward passes run in: auto (default): float32 where a quick probe finds float32 "
        "matmuls at least twice as fast as the model's 16-bit ones (mlx's CPU backend with a fast BLAS), "
        "else the model's dtype; float32; model. Recorded in the file",
    )
    args = parser.parse_args(list(argv))

    from kvspec import KVSpecError

    from .calibration.fit import _compute_dtype, calibrate

    model_path = _model_path(args.model, quiet=False)
    text = _read_text(args.text)
    model, tokenizer = _load_model(model_path, args.model)
    dtype = args.dtype
    if dtype == "auto":  # decided here, before the run, so the note below can come first
        dtype = "model" if _compute_dtype(model, "auto") is None else "float32"
        hint = None if dtype == "float32" or args.quiet else _blas_hint(model)
        if hint:
            print(hint, file=sys.stderr)
    try:
        result = calibrate(
            model,
            tokenizer,
            text,
            window=args.window,
            max_tokens=args.max_tokens,
            progress=not args.quiet,
            weighting=args.weighting,
            dtype=dtype,
        )
        result.save(args.out)
    except (KVSpecError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    m = result.model
    print(
        f"wrote {args.out}: {m['architecture']}, {m['n_layers']} layers x {m['n_kv_heads']} KV heads x "
        f"head dim {m['head_dim']}, {result.tokens} tokens, keys {'before' if result.pre_rope else 'after'} RoPE, "
        f"weighting {result.weighting}, forward passes in {result.compute_dtype}"
    )
    return 0


def sensitivity_main(argv: Sequence[str]) -> int:
    """``palu-mlx sensitivity``: returns the exit code (1 with a one-line error on a user mistake)."""
    return _reporting_mistakes(_sensitivity_command, argv)


def _sensitivity_command(argv: Sequence[str]) -> int:
    parser = _model_command_parser("palu-mlx sensitivity", _SENSITIVITY_HELP)
    parser.add_argument(
        "--out",
        default=None,
        help="profile to write (.json; default: <model directory>.palu-sensitivity.json beside a local "
        "model, where the +sens budgets and the benchmarks look; a hub id needs --out)",
    )
    parser.add_argument(
        "--text",
        default=None,
        help="UTF-8 text to measure on (default: the calibration text shipped with palu-mlx, never "
        "kvbench's evaluation text)",
    )
    parser.add_argument(
        "--bits", type=_bit_budget, default=2.0, help="code bits per element of the probed tensor (default 2)"
    )
    parser.add_argument(
        "--context", type=_positive_int, default=512, help="tokens of context per window (default 512)"
    )
    parser.add_argument(
        "--scored",
        type=_positive_int,
        default=64,
        help="positions per window whose next-token distributions are compared (default 64)",
    )
    parser.add_argument("--windows", type=_positive_int, default=2, help="windows of text (default 2)")
    _add_run_options(
        parser,
        "what the forward passes run in: auto (default): float32 where a quick probe finds float32 "
        "matmuls at least twice as fast as the model's 16-bit ones, else the model's dtype; float32; "
        "model. In float32 the keys and values are rounded to the model's dtype as they are cached",
    )
    args = parser.parse_args(list(argv))

    import os
    import time
    from pathlib import Path

    from kvspec import KVSpecError
    from tqdm import tqdm

    from .budgets import measure_sensitivity, profile_path, spread_windows
    from .calibration.fit import _compute_dtype, _model_dtype, default_calibration_text

    model_path = _model_path(args.model, quiet=args.quiet)
    if args.out is not None:
        out = Path(args.out)
    elif os.path.isdir(model_path):
        out = profile_path(model_path)
    else:
        print(
            f"error: --model {args.model!r} is not a local model directory, so there is no place beside "
            "it for the profile; pass --out FILE",
            file=sys.stderr,
        )
        return 1
    if out.is_dir() or not out.parent.is_dir():
        print(f"error: --out {str(out)!r} must be a file in an existing directory", file=sys.stderr)
        return 1
    text = _read_text(args.text)
    if text is None:
        text = default_calibration_text()
    model, tokenizer = _load_model(model_path, args.model)
    # the text is tokenized whole, then cut into windows; the length warning does not apply
    getattr(tokenizer, "_tokenizer", tokenizer).model_max_length = int(1e12)
    try:
        windows = spread_windows(
            tokenizer.encode(text, add_special_tokens=False), args.windows, args.context + args.scored
        )
    except KVSpecError as exc:
        print(f"error: --text / --windows / --context / --scored: {exc}", file=sys.stderr)
        return 1
    compute = _compute_dtype(model, args.dtype)
    runs_in = str(compute if compute is not None else _model_dtype(model)).removeprefix("mlx.core.")
    kv_dtype = None
    if compute is not None:
        # matmuls in float32; the caches hold what the model's own dtype would
        kv_dtype = _model_dtype(model)
        model.set_dtype(compute)
    elif args.dtype == "auto" and not args.quiet:
        hint = _blas_hint(model)
        if hint:
            print(hint.replace("calibration", "the measurement"), file=sys.stderr)
    n_layers = len(model.layers)
    bar = tqdm(
        total=args.windows * n_layers * 2, desc="palu-mlx sensitivity", unit="probe", disable=args.quiet
    )

    def progress(line: str) -> None:
        bar.set_postfix_str(line, refresh=False)
        bar.update(1)

    started = time.perf_counter()
    try:
        profile = measure_sensitivity(
            model, windows, args.scored, args.bits, progress=progress, kv_dtype=kv_dtype
        )
        profile.save(out)
    except (KVSpecError, ValueError, OSError) as exc:
        bar.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    bar.close()
    seconds = time.perf_counter() - started
    ranked = sorted(
        (
            (kl, f"layer {i} {name}")
            for name, kls in (("keys", profile.key_kl), ("values", profile.value_kl))
            for i, kl in enumerate(kls)
        ),
        reverse=True,
    )
    m = profile.model
    print(
        f"wrote {out}: {m['architecture']}, {m['n_layers']} layers x {m['n_kv_heads']} KV heads x head dim "
        f"{m['head_dim']}, {args.windows} window(s) of {args.context} + {args.scored} tokens at "
        f"{args.bits:g} bits, forward passes in {runs_in}, "
        f"{seconds:.0f} s; KL summed over layers: keys {sum(profile.key_kl):.3g}, values "
        f"{sum(profile.value_kl):.3g}; most sensitive: {ranked[0][1]} ({ranked[0][0]:.3g}). "
        f"Use it with KVCacheConfig(palu_sensitivity={str(out)!r})"
    )
    return 0


def _compare():
    from .compare import main

    return main


def _calibrate():
    return calibrate_main


def _sensitivity():
    return sensitivity_main


def _generate():
    from .generate import generate_main

    return generate_main


def _server():
    from .server import server_main

    return server_main


_COMMANDS = {
    "generate": (_GENERATE_HELP, _generate),
    "server": (_SERVER_HELP, _server),
    "compare": ("compare palu tiers with mlx-lm's caches on a model", _compare),
    "calibrate": (_CALIBRATE_HELP, _calibrate),
    "sensitivity": (_SENSITIVITY_HELP, _sensitivity),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``palu-mlx <command>``; returns the exit code (2 for an unknown command)."""
    if argv is not None and (
        not isinstance(argv, (list, tuple)) or not all(isinstance(a, str) for a in argv)
    ):
        from kvspec import KVConfigError

        raise KVConfigError(f"argv={argv!r} must be None (the command line) or a list of str arguments")
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        from kvbench.cli import dispatch
    except ImportError:
        if args and args[0] in _COMMANDS and args[0] != "compare":
            return _COMMANDS[args[0]][1]()(args[1:])
        print('error: palu-mlx compare needs kvbench: pip install "palu-mlx[compare]"', file=sys.stderr)
        return 2
    return dispatch("palu-mlx", _COMMANDS, args)


if __name__ == "__main__":
    sys.exit(main())
