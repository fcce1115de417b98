"""What a chat tab needs from a package: load a model, list its caches, build a native/compressed pair.

A :class:`Backend` wraps the package's compare harness (``harness.load`` and
``harness.candidates``), so the app builds exactly the caches ``<package> compare`` builds. The
two subclasses (:mod:`demo.flashcodec_backend`, :mod:`demo.palu_backend`) add what differs: the
framework's memory counter and, for flashcodec, the materialization-free twin of a tier.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from kvbench.cli import Loaded
from kvbench.protocol import Candidate

from .chat import generate
from .worker import ModelWorker

__all__ = ["DemoError", "Backend", "check_fits"]


class DemoError(ValueError):
    """A mistake the user can fix (empty prompt, too long a conversation, a toggle that does not
    apply); its message is shown in the page."""


def check_fits(tokens: int, limit: int | None, what: str) -> None:
    """DemoError when ``tokens`` positions exceed the model's ``limit`` (None: no known limit)."""
    if limit and tokens > limit:
        raise DemoError(
            f"{what} needs {tokens} positions but the model allows {limit}: "
            "shorten the prompt, ask for fewer new tokens, or clear the chat"
        )


class Backend:
    """One package's side of the app. Every method that touches the model runs on :attr:`worker`."""

    #: short key used in element ids ("flashcodec", "palu")
    key: str
    #: the tab's title
    title: str
    #: the compressed cache whose greedy text should equal the native one's
    lossless: str
    #: the compressed cache a new chat starts with
    default_choice: str
    #: whether the materialization-free toggle applies to this package
    has_materialization_free: bool = False

    def __init__(self, harness: Any, dtype: str):
        self.harness = harness
        self.dtype = dtype
        self.worker = ModelWorker(self.key)
        self._model_key: str | None = None
        self._loaded: Loaded | None = None

    # ------------------------------------------------------------------ model
    def model_args(self, model: str | None) -> argparse.Namespace:
        """The harness's command-line arguments for ``model`` (None: the embedded model)."""
        return argparse.Namespace(model=model, dtype=self.dtype)

    def load(self, model: str | None) -> Loaded:
        """The loaded model (the last one is kept: a chat reloads only when the model changes).
        Raises the harness's CompareError (a ValueError, one line) when it cannot be loaded."""
        key = (model or "").strip() or None
        if self._loaded is None or key != self._model_key:
            self._loaded = None  # free the old model before loading the next
            loaded = self.harness.load(self.model_args(key))
            _warm_up(loaded, self.harness.candidates(loaded, [], [])[0][0])
            self._loaded, self._model_key = loaded, key
        return self._loaded

    def memory_now(self, loaded: Loaded) -> int | None:
        """Bytes the framework has in use now (the steady-memory reading)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ caches
    def tier_names(self) -> list[str]:
        """Every tier of the package's registry, in its order."""
        return list(self.harness.tiers())

    def peer_names(self) -> list[str]:
        return list(self.harness.peers())

    def chat_choices(self) -> list[str]:
        """What the chat tab offers for the right panel."""
        return self.tier_names() + self.peer_names()

    def resolve(self, choice: str, materialization_free: bool) -> str:
        """The cache to build for ``choice`` with the toggle as given (DemoError when it does not apply)."""
        if choice not in self.chat_choices():
            raise DemoError(f"unknown cache {choice!r}; pick one of: {', '.join(self.chat_choices())}")
        if materialization_free:
            raise DemoError(f"the materialization-free toggle does not apply to {self.title}")
        return choice

    def candidates(self, loaded: Loaded, names: Sequence[str]) -> tuple[list[Candidate], list[dict]]:
        """Baseline first, then the named tiers and peers that can run here, built by the harness;
        and the peers that cannot (``{"name", "kind", "reason"}``). CompareError when the model
        cannot take a tier."""
        tiers = [n for n in self.tier_names() if n in names]
        peers = [n for n in self.peer_names() if n in names]
        return self.harness.candidates(loaded, tiers, peers)

    def pair(self, loaded: Loaded, choice: str, materialization_free: bool) -> tuple[Candidate, Candidate]:
        """``(native, compressed)`` candidates for one chat turn."""
        name = self.resolve(choice, materialization_free)
        built, absent = self.candidates(loaded, [name])
        if absent:
            raise DemoError(f"{name} cannot run here: {absent[0]['reason']}")
        return built[0], built[1]

    # ------------------------------------------------------------------ text
    def turn_tokens(self, loaded: Loaded, message: str, first: bool) -> list[int]:
        """Tokens of one user message: through the model's chat template when it has one, else
        as plain text that continues the conversation (a base model, like the embedded one)."""
        tokenizer = loaded.runner.tokenizer
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
            )
            return loaded.encode_text(text)
        if first:
            return loaded.encode_prompt(message)
        return loaded.encode_text("\n\n" + message)

    def stop_tokens(self, loaded: Loaded) -> frozenset[int]:
        """Token ids that end a reply (the tokenizer's end-of-text ids)."""
        tokenizer = loaded.runner.tokenizer
        ids = getattr(tokenizer, "eos_token_ids", None) or [getattr(tokenizer, "eos_token_id", None)]
        return frozenset(int(i) for i in ids if i is not None)


def _warm_up(loaded: Loaded, baseline: Candidate) -> None:
    # First calls pay one-time costs (kernel selection, allocator growth, lazy imports) that would
    # otherwise land in the first turn's native figures, since the native side runs first (as
    # kvbench's protocol warms up before it measures).
    prompt = loaded.encode_prompt("Warm-up: one short prompt and a few greedy tokens.")
    generate(loaded.runner, baseline, prompt, 8, frozenset(), lambda: None, lambda _: None)
