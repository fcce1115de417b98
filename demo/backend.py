"""What a chat tab needs from a package: load a model, list its caches, build a native/compressed pair.

A :class:`Backend` wraps the package's compare harness (``harness.load`` and
``harness.candidates``), so the app builds exactly the caches ``<package> compare`` builds. The
two subclasses (:mod:`demo.flashcodec_backend`, :mod:`demo.palu_backend`) add what differs: the
framework's memory counter, for flashcodec the choice of what a tier attends on (its codes or a
decoded view), for palu the dtype its model computes in. The base class turns a conversation into the prompt's tokens (the
model's chat template when it has one) and knows which tokens end a reply.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbench.cli import Loaded
from kvbench.models import DEFAULT_MODEL
from kvbench.protocol import Candidate

from .chat import generate
from .worker import ModelWorker

__all__ = ["DemoError", "Backend", "check_fits", "model_key", "has_chat_template"]


class DemoError(ValueError):
    """A mistake the user can fix (empty prompt, too long a conversation, an attention choice that
    does not apply); its message is shown in the page."""


def check_fits(tokens: int, limit: int | None, what: str) -> None:
    """DemoError when ``tokens`` positions exceed the model's ``limit`` (None: no known limit)."""
    if limit and tokens > limit:
        raise DemoError(
            f"{what} needs {tokens} positions but the model allows {limit}: "
            "shorten the prompt, ask for fewer new tokens, or clear the chat"
        )


def model_key(model: str | None) -> str:
    """What the Model field means: a named model (``kvbench.models.model_names()``), a path or a
    hub id; empty means kvbench's default model, named, so that an empty field and the default's
    name are one model (loaded once, one conversation)."""
    return (model or "").strip() or DEFAULT_MODEL


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (transformers', or mlx-lm's wrapper, which forwards to it) has a chat
    template to render a conversation with."""
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


class Backend:
    """One package's side of the app. Every method that touches the model runs on :attr:`worker`."""

    #: short key used in element ids ("flashcodec", "palu")
    key: str
    #: the tab's title
    title: str
    #: the compressed cache closest to the native one (a lossless or a change-of-basis tier): its
    #: greedy text should equal the native one's on a short prompt
    closest_choice: str
    #: the compressed cache a new chat starts with
    default_choice: str
    #: what the attention control offers (value, label), the first the default: ``tier`` is each
    #: tier's own attention; empty where the package has no such choice
    attention_choices: tuple[tuple[str, str], ...] = ()
    #: the attention a conversation starts with (``tier``: each tier's own)
    default_attention = "tier"

    def __init__(self, harness: Any, dtype: str):
        self.harness = harness
        self.dtype = dtype
        self.worker = ModelWorker(self.key)
        self._model_key: str | None = None
        self._loaded: Loaded | None = None

    # ------------------------------------------------------------------ model
    def model_args(self, model: str) -> argparse.Namespace:
        """The harness's command-line arguments for ``model`` (a name, a path or a hub id)."""
        return argparse.Namespace(model=model, dtype=self.dtype)

    def load(self, model: str | None) -> Loaded:
        """The loaded model (the last one is kept: a chat reloads only when the model changes);
        ``model`` as the Model field gives it (:func:`model_key`). Raises the harness's
        CompareError (a ValueError, one line) when it cannot be loaded."""
        key = model_key(model)
        if self._loaded is None or key != self._model_key:
            self._loaded = None  # free the old model before loading the next
            loaded = self.prepare(self.harness.load(self.model_args(key)))
            _warm_up(loaded, self.harness.candidates(loaded, [], [])[0][0])
            self._loaded, self._model_key = loaded, key
        return self._loaded

    def prepare(self, loaded: Loaded) -> Loaded:
        """What the backend adjusts on a model the harness loaded (nothing by default)."""
        return loaded

    def precision_note(self, loaded: Loaded | None = None) -> str:
        """One line on the dtypes the model computes and caches in, for the tab."""
        return f"model and caches in {self.dtype}"

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

    def check_choice(self, choice: str, attention: str) -> None:
        """DemoError unless ``choice`` is offered and ``attention`` applies to it (this package has
        no attention choice: only ``tier``, each tier's own)."""
        if choice not in self.chat_choices():
            raise DemoError(f"unknown cache {choice!r}; pick one of: {', '.join(self.chat_choices())}")
        if attention != "tier":
            raise DemoError(f"the attention choice does not apply to {self.title}; got {attention!r}")

    def candidates(
        self, loaded: Loaded, names: Sequence[str], attention: str = "tier"
    ) -> tuple[list[Candidate], list[dict]]:
        """Baseline first, then the named tiers and peers that can run here, built by the harness;
        and the peers that cannot (``{"name", "kind", "reason"}``). CompareError when the model
        cannot take a tier."""
        tiers = [n for n in self.tier_names() if n in names]
        peers = [n for n in self.peer_names() if n in names]
        return self.harness.candidates(loaded, tiers, peers)

    def pair(self, loaded: Loaded, choice: str, attention: str) -> tuple[Candidate, Candidate]:
        """``(native, compressed)`` candidates for one chat turn: ``choice`` with ``attention``."""
        self.check_choice(choice, attention)
        built, absent = self.candidates(loaded, [choice], attention)
        if absent:
            raise DemoError(f"{choice} cannot run here: {absent[0]['reason']}")
        return built[0], built[1]

    def cache_label(self, candidate: Candidate) -> str:
        """How the page names the compressed cache of a turn (its name by default)."""
        return candidate.name

    # ------------------------------------------------------------------ text
    def prompt_tokens(self, loaded: Loaded, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Tokens of a whole conversation (``{"role", "content"}`` dicts, the user's new message
        last), ready for the assistant's reply.

        A model with a chat template gets the conversation through it, with the prompt that opens
        the assistant's turn; the template's text already holds its special tokens, so none are
        added. A model without one (a base model, like the embedded one) gets the turns as plain
        text: each reply continues the message before it, each new message opens a paragraph.
        """
        tokenizer = loaded.runner.tokenizer
        if has_chat_template(tokenizer):
            text = tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
            )
            return loaded.encode_text(text)
        text = ""
        for m in messages:
            if m["role"] == "user" and text:
                text += "\n\n"
            text += m["content"]
        return loaded.encode_prompt(text)

    def stop_tokens(self, loaded: Loaded) -> frozenset[int]:
        """Token ids that end a reply: the tokenizer's end-of-text ids and the model's
        ``generation_config`` ones (an instruct model's end-of-turn token, such as SmolLM2's
        ``<|im_end|>``, is among them)."""
        tokenizer = loaded.runner.tokenizer
        ids = _ids(getattr(tokenizer, "eos_token_ids", None)) | _ids(getattr(tokenizer, "eos_token_id", None))
        return frozenset(ids | _ids(_generation_eos(loaded)))

    def reply_text(self, loaded: Loaded, tokens: Sequence[int], stop: frozenset[int]) -> str:
        """The text of a reply, without the stop token that ended it (the chat template writes
        the end of each turn itself when the conversation is rendered again)."""
        if tokens and tokens[-1] in stop:
            tokens = tokens[:-1]
        return loaded.runner.detokenize(list(tokens))


def _ids(value: Any) -> set[int]:
    """Token ids from a config value: None, one id, or a list of them."""
    if value is None:
        return set()
    if isinstance(value, int):
        return {int(value)}
    if isinstance(value, Iterable) and not isinstance(value, str):
        return {int(i) for i in value if isinstance(i, int)}
    return set()


def _generation_eos(loaded: Loaded) -> Any:
    """``eos_token_id`` of the model's generation config: the loaded model's (transformers), else
    ``generation_config.json`` in the model's directory (mlx-lm does not keep it)."""
    config = getattr(loaded.handle, "generation_config", None)
    if config is not None and getattr(config, "eos_token_id", None) is not None:
        return config.eos_token_id
    source = (loaded.info or {}).get("source")
    path = Path(source) / "generation_config.json" if source else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None


def _warm_up(loaded: Loaded, baseline: Candidate) -> None:
    # First calls pay one-time costs (kernel selection, allocator growth, lazy imports) that would
    # otherwise land in the first turn's native figures, since the native side runs first (as
    # kvbench's protocol warms up before it measures).
    prompt = loaded.encode_prompt("Warm-up: one short prompt and a few greedy tokens.")
    generate(loaded.runner, baseline, prompt, 8, frozenset(), lambda: None, lambda _: None)
