"""What ``palu-mlx generate`` and ``palu-mlx server`` share: ``--model`` names and palu's options.

* :func:`resolve_model_arg`: ``--model`` takes a local directory, a hub id, or one of kvbench's
  named models (``smollm2-135m``, ``tiny-qwen3``). kvbench is imported only for a name that is
  neither a directory nor a hub id, so palu-mlx does not need it otherwise.
* :func:`add_palu_arguments` / :func:`palu_config`: ``--palu-bits``, ``--palu-tier``,
  ``--calibration`` and the :class:`~palu_mlx.config.KVCacheConfig` they mean for a model; or
  ``--kv-memory SIZE`` (with ``--kv-context`` and the server's ``--kv-users``): the tier a memory
  plan chooses (:mod:`palu_mlx.memory_plan`). :func:`check_palu_arguments` refuses what does not
  go together before a model is loaded.
* :func:`kv_bytes`: what a prompt cache holds, measured, against what an uncompressed cache of the
  same tokens would.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from kvspec import KVConfigError

from .builder import KVCacheBuilder
from .config import KVCacheConfig
from .tiers import DEFAULT_TIER, TIERS

__all__ = [
    "ModelNameError",
    "resolve_model_arg",
    "add_palu_arguments",
    "check_palu_arguments",
    "palu_config",
    "kv_bytes",
]

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class ModelNameError(KVConfigError):
    """``--model`` names nothing palu-mlx can load (or a named model cannot be made)."""


def resolve_model_arg(model: str, quiet: bool = False) -> str:
    """What to load for ``--model``: a local directory or hub id as given, a named model's directory.

    Named models come from ``kvbench.models.resolve_model`` (imported here, only when needed).
    Raises :class:`ModelNameError` when the name is none of these or kvbench is not installed, and
    when it can only be a local path (absolute, ``./``, ``~``, a file) that is no directory.
    """
    if not isinstance(model, str) or not model:
        raise ModelNameError(f"--model {model!r} must be a local directory, a hub id or a named model")
    if os.path.isdir(model):
        return model
    if _looks_like_a_path(model):
        # mlx-lm would take it for a hub id and fail with a hub validation traceback
        what = "is a file, not a model directory" if os.path.exists(model) else "is no such directory"
        raise ModelNameError(
            f"--model {model!r} {what}; give a local model directory (with config.json), a hub id "
            "(owner/name) or a named model (smollm2-135m, tiny-qwen3)"
        )
    try:
        from kvbench.models import model_names, resolve_model
    except ImportError:
        if _HUB_ID.match(model):
            return model
        raise ModelNameError(
            f"--model {model!r} is neither a local directory nor a hub id (owner/name); named models "
            '(smollm2-135m, tiny-qwen3) need kvbench: pip install "palu-mlx[compare]"'
        ) from None
    if model not in model_names():
        return model  # a hub id (or a path mlx_lm.load will report on)
    try:
        return resolve_model(model, quiet=quiet)
    except Exception as exc:  # noqa: BLE001 - fetching / converting a named model fails in many ways
        raise ModelNameError(f"--model {model!r}: the named model cannot be made: {exc}") from None


def _looks_like_a_path(model: str) -> bool:
    """A ``--model`` that can only mean a local path: absolute, relative to . / .. / ~, an existing
    file, or with more separators than a hub id's ``owner/name``."""
    if os.path.isabs(model) or model.startswith(("./", "../", "~", ".\\", "..\\")) or os.path.exists(model):
        return True
    return (os.sep in model or "/" in model) and not _HUB_ID.match(model)


def _bits(value: str) -> float:
    try:
        bits = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of bits") from None
    if not 0 < bits <= 8:
        raise argparse.ArgumentTypeError(f"{value!r}: code bits per element must be in (0, 8]")
    return bits


def _memory(value: str) -> int:
    from .memory_plan import parse_size

    try:
        return parse_size(value)
    except KVConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _at_least_one(what: str) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of {what}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"{value!r}: the number of {what} must be at least 1")
        return n

    parse.__name__ = what  # argparse names the type in its own messages
    return parse


def add_palu_arguments(parser: argparse.ArgumentParser, kv_users: bool = False) -> None:
    """Add palu's options (one argument group) to an mlx-lm command's parser.

    ``kv_users``: add ``--kv-users`` (the server holds several sequences at once; ``palu-mlx
    generate`` plans for its one).
    """
    group = parser.add_argument_group("palu-mlx KV cache")
    choice = group.add_mutually_exclusive_group()
    choice.add_argument(
        "--palu-bits",
        type=_bits,
        default=None,
        metavar="BITS",
        help="code bits per K/V element of the fitted latent cache, by water-filling (default: the "
        f"default tier, {DEFAULT_TIER})",
    )
    choice.add_argument(
        "--palu-tier",
        choices=tuple(TIERS),
        default=None,
        metavar="NAME",
        help=f"a named palu tier instead of --palu-bits: {', '.join(TIERS)}",
    )
    choice.add_argument(
        "--kv-memory",
        type=_memory,
        default=None,
        metavar="SIZE",
        help="memory for the KV caches instead of a tier or bits (e.g. 512M, 2G, 1.5GiB; K, M, G, T are "
        "powers of 1024): the best-quality tier whose caches, measured on the model, fit it",
    )
    group.add_argument(
        "--kv-context",
        type=_at_least_one("tokens"),
        default=None,
        metavar="TOKENS",
        help="with --kv-memory: tokens per sequence to plan for (default: the model's max position "
        "embeddings, else 4096)",
    )
    if kv_users:
        group.add_argument(
            "--kv-users",
            type=_at_least_one("users"),
            default=None,
            metavar="N",
            help="with --kv-memory: sequences held at once to plan for (default 1)",
        )
    group.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="calibration file written by `palu-mlx calibrate` for this model (fixed per-head projections)",
    )


def check_palu_arguments(args: argparse.Namespace) -> None:
    """Refuse palu options that do not go together (no model needed, so before one loads).

    ``--kv-context`` and ``--kv-users`` plan a ``--kv-memory`` and mean nothing without it; the
    tiers a memory plan chooses from have no calibrated twins, so ``--kv-memory`` refuses
    ``--calibration``. Raises ``KVConfigError``.
    """
    if getattr(args, "kv_memory", None) is None:
        given = [
            flag
            for flag, name in (("--kv-context", "kv_context"), ("--kv-users", "kv_users"))
            if getattr(args, name, None) is not None
        ]
        if given:
            raise KVConfigError(
                f"{' and '.join(given)} plan{'s' if len(given) == 1 else ''} the KV memory of --kv-memory "
                "SIZE; give --kv-memory too, or leave "
                f"{'it' if len(given) == 1 else 'them'} out"
            )
    elif getattr(args, "calibration", None) is not None:
        raise KVConfigError(
            "--kv-memory with --calibration: the tiers a memory plan chooses from have no calibrated "
            "twin; choose one with --palu-tier, or leave out --calibration"
        )


def palu_config(
    model: Any, args: argparse.Namespace, report: Callable[[str], Any] | None = None
) -> KVCacheConfig:
    """The :class:`KVCacheConfig` that ``args``' palu options mean for ``model``.

    With ``--kv-memory`` the tier :func:`palu_mlx.memory_plan.plan` chooses for ``--kv-users``
    (default 1) sequences of ``--kv-context`` tokens (default: the model's max position embeddings,
    else 4096) in that memory; ``report`` (if given) gets its one-line summary.

    Otherwise ``--palu-tier`` (or ``KVCacheConfig(palu_bits=...)`` for ``--palu-bits``, or the
    default tier) with ``--calibration``, as :meth:`KVCacheBuilder.config_for` reads them, the rule
    ``palu-mlx compare`` and the Python API share. Raises ``KVConfigError`` for an unknown tier, a
    tier with no calibrated twin given a calibration, or a calibration that is not a file.
    """
    check_palu_arguments(args)
    memory = getattr(args, "kv_memory", None)
    if memory is not None:
        from .memory_plan import default_context, plan

        context = getattr(args, "kv_context", None) or default_context(model)
        made = plan(model, memory, context, getattr(args, "kv_users", None) or 1)
        if report is not None:
            report(made.summary())
        return made.config
    tier_name = getattr(args, "palu_tier", None)
    calibration = getattr(args, "calibration", None)
    if calibration is not None and not os.path.isfile(calibration):
        raise KVConfigError(
            f"--calibration {calibration!r} is not a file; make one with `palu-mlx calibrate`"
        )
    if tier_name is not None and tier_name not in TIERS:
        raise KVConfigError(f"--palu-tier {tier_name!r} is not a palu tier; allowed: {', '.join(TIERS)}")
    choice: KVCacheConfig | str | None = tier_name
    bits = getattr(args, "palu_bits", None)
    if choice is None and bits is not None:
        choice = KVCacheConfig(palu_bits=bits)
    return KVCacheBuilder.config_for(model, choice, calibration)


def describe(config: KVCacheConfig) -> str:
    """One line naming a config's code, bits, weighing, per-token scales, exact tokens and calibration, for logs."""
    if config.method == "rotation":
        coder = config.coder
        bits = f"{coder.key_bits} bits per rotated key channel and {coder.value_bits} per value channel"
        parts, how = [bits], "a fixed rotation, nothing fitted but each head's mean"
    else:
        if config.palu_calibration is not None:
            how = f"calibrated from {config.palu_calibration}"
        else:
            how = "projections fitted per sequence"
        bits = config.coder_bits
        parts = [f"{bits:g} code bits per element" if bits is not None else "rank / hi-lo split"]
        if bits is not None:
            parts.append(
                "keys and values weighed by "
                + ("relative" if config.relative_error else "squared")
                + " error"
            )
    if config.palu_token_scale and not config.uses_split:
        parts.append("per-token scales")
    sink, recent = config.palu_sink_tokens, config.palu_recent_tokens
    if config.palu_recent_bits == 8 and recent:
        parts.append(f"first {sink} tokens exact, newest {recent} in int8")
    elif sink or recent:
        parts.append(f"first {sink} and newest {recent} tokens exact")
    return f"palu KV cache: {', '.join(parts)}, {how}"


def kv_bytes(cache: Sequence[Any]) -> tuple[int, int]:
    """``(held, uncompressed)`` bytes of a prompt cache.

    ``held``: every layer's ``nbytes`` (measured from the arrays held). ``uncompressed``: what a
    16-bit-or-input-dtype cache of the same tokens would hold: palu layers' ``raw_nbytes``
    (``dtype size x elements``, a formula); other layers count as what they hold.
    """
    held = raw = 0
    for layer in cache:
        n = int(layer.nbytes)
        held += n
        raw += int(getattr(layer, "raw_nbytes", n))
    return held, raw
