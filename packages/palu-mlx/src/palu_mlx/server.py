"""``palu-mlx server``: mlx-lm's OpenAI-compatible server with palu's KV cache.

Everything but the cache is mlx-lm's: its argument parser (every ``mlx_lm.server`` option, with
its defaults), its HTTP handler and errors, its prompt cache (``LRUPromptCache``) and its batch
generator. :class:`PaluModelProvider` is mlx-lm's ``ModelProvider`` with one change: right
after a model loads it installs palu caches (``KVCacheBuilder.install``), and then decides, as
mlx-lm does, whether the model is batchable (every layer cache has ``merge``). palu caches have
one (:mod:`palu_mlx.batch`), so concurrent requests are batched; a draft model or ``--kv-bits``
(which palu refuses) would send requests to mlx-lm's one-at-a-time path, and the log says which.

The prompt cache keeps each conversation's palu caches, compressed, and reuses them for
follow-ups the way it reuses mlx-lm's own caches (trimmed to the common prefix). With
``--prompt-cache-dir DIR`` it also writes them to DIR and loads them back after a restart
(:mod:`palu_mlx.prompt_store`).

A request's ``"model"`` may also be the name the server was started with (``--model
tiny-qwen3``) or the path it resolved to: both mean the loaded model, as ``default_model`` does.
When another model is loaded, the old one's palu install is undone first (its ``make_cache``
refers back to the model, a cycle reference counting alone never frees) and the garbage
collector and MLX's buffer cache are run, so its weights are returned.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import types
from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.server import ModelProvider

from .builder import KVCacheBuilder
from .config import KVCacheConfig
from .serving import describe, palu_config

__all__ = ["PaluModelProvider", "server_parser", "server_main"]

_log = logging.getLogger("palu_mlx.server")


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__("parser captured")
        self.parser = parser


class _CapturingParser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):  # noqa: D401 - argparse's signature
        raise _Captured(self)


def _mlx_server_parser() -> argparse.ArgumentParser:
    """mlx-lm's own ``mlx_lm.server`` parser, every option and default as mlx-lm defines them.

    mlx-lm builds it inside ``mlx_lm.server.main`` and parses at once; running ``main`` with
    that module's ``argparse`` seen through a parser class whose ``parse_args`` hands the parser
    back (before anything is loaded or served) gives it without copying it.
    """
    import mlx_lm.server as mlx_server

    shim = types.SimpleNamespace(**vars(argparse))
    shim.ArgumentParser = _CapturingParser
    real = mlx_server.argparse
    mlx_server.argparse = shim
    try:
        mlx_server.main()
    except _Captured as captured:
        parser = captured.parser
        parser.__class__ = argparse.ArgumentParser  # parses for real from now on
        return parser
    finally:
        mlx_server.argparse = real
    raise RuntimeError("mlx_lm.server.main did not build its argument parser as expected")


def server_parser() -> argparse.ArgumentParser:
    """mlx-lm's server parser with palu's options added (``palu-mlx server --help``)."""
    from .prompt_store import add_store_arguments
    from .serving import add_palu_arguments

    parser = _mlx_server_parser()
    parser.prog = "palu-mlx server"
    parser.description = "mlx-lm's OpenAI-compatible HTTP server with palu's compressed KV cache"
    add_palu_arguments(parser, kv_users=True)
    add_store_arguments(parser)
    return parser


class PaluModelProvider(ModelProvider):
    """mlx-lm's ``ModelProvider`` that installs palu caches on every model it loads.

    ``cli_args`` carries palu's options (``palu_bits``, ``palu_tier``, ``calibration``,
    ``kv_memory``, ``kv_context``, ``kv_users``) beside mlx-lm's; a memory plan is made, and
    logged, for every model loaded. After the install, ``is_batchable`` is decided again the way
    mlx-lm decides it.
    """

    palu_config: KVCacheConfig | None = None

    def __init__(self, cli_args: argparse.Namespace, model_name: str | None = None):
        """``model_name``: what ``--model`` said before it was resolved (a named model such as
        ``tiny-qwen3``); requests naming it, or the resolved path, get the loaded model."""
        super().__init__(cli_args)
        if cli_args.model is not None:
            names = {model_name, cli_args.model}
            if os.path.isdir(cli_args.model):
                names.add(os.path.abspath(cli_args.model))
            for name in names - {None, "default_model"}:
                # mapped as mlx-lm maps "default_model", so the request's key is the loaded one's
                self._model_map[name] = cli_args.model
                self._adapter_map[name] = cli_args.adapter_path

    def reset(self) -> None:
        """Drop the model (mlx-lm's ``reset``) and return its memory.

        Undoing the palu install breaks the model -> make_cache -> model cycle, so the weights go
        as soon as the last caller's reference does, without waiting for a garbage collection.
        """
        if self.model is not None:
            KVCacheBuilder.uninstall(self.model)
        super().reset()
        self.palu_config = None
        gc.collect()
        mx.clear_cache()

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        super()._load(model_path, adapter_path, draft_model_path)
        config = palu_config(self.model, self.cli_args, report=_log.info)
        KVCacheBuilder.install(self.model, config)
        self.palu_config = config
        # mlx-lm's rule, on the caches the model now makes
        unmerged = sorted(
            {type(c).__name__ for c in make_prompt_cache(self.model) if not hasattr(c, "merge")}
        )
        self.is_batchable = self.draft_model is None and not unmerged
        if self.is_batchable:
            path = "batched (palu caches merge into palu_mlx.batch.BatchedLayerCache)"
        elif self.draft_model is not None:
            path = "one request at a time (a draft model is loaded)"
        else:
            path = f"one request at a time ({', '.join(unmerged)} cannot be batched)"
        _log.info("%s: %s; requests are served %s", model_path, describe(config), path)


def server_main(argv: Sequence[str]) -> int:
    """``palu-mlx server``: serves until interrupted; returns the exit code (1 on a bad option)."""
    parser = server_parser()
    args = parser.parse_args(list(argv))
    if args.kv_bits is not None:
        print(
            f"error: --kv-bits {args.kv_bits}: mlx-lm's quantized cache replaces palu's; use --palu-bits",
            file=sys.stderr,
        )
        return 1

    from kvspec import KVSpecError
    from mlx_lm.server import run
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    from .prompt_store import PromptStoreError, open_store, serve
    from .serving import ModelNameError, check_palu_arguments, resolve_model_arg

    try:
        check_palu_arguments(args)
    except KVSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    given = args.model
    if args.model is not None:
        try:
            args.model = resolve_model_arg(args.model)
        except ModelNameError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), None),
        format="%(asctime)s - %(levelname)s - %(message)s",
    )
    try:
        store = open_store(args)
    except PromptStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _ = maybe_set_recommended_wired_limit()
    provider = PaluModelProvider(args, model_name=given)
    if args.model is not None:
        # load (and install palu) now, so a bad --model or palu option fails before serving
        try:
            provider.load_default()
        except KVSpecError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:  # noqa: BLE001 - any loading failure is the user's --model
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"error: --model {given!r} cannot be loaded: {detail}", file=sys.stderr)
            return 1
    if store is None:
        run(args.host, args.port, provider)
    else:
        serve(args.host, args.port, provider, store)
    return 0
