"""A runner and a backend without a model: token t is always followed by t + 1 (mod the vocabulary)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
from kvbench.cli import Loaded
from kvbench.protocol import Candidate, KVBytes

from demo.backend import Backend

VOCAB = 8


class ChatTokenizer:
    """A tokenizer with a chat template: records every conversation it renders.

    Its template writes each message as ``<role> content </role>`` and, with
    ``add_generation_prompt``, opens the assistant's turn with ``<assistant>``.
    """

    chat_template = "{% for m in messages %}<{{ m.role }}> {{ m.content }} </{{ m.role }}> {% endfor %}"
    eos_token_id = 7

    def __init__(self) -> None:
        self.rendered: list[tuple[list[dict[str, str]], bool]] = []

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        assert not tokenize, "the demo renders text, then encodes it with the harness's encoder"
        self.rendered.append(([dict(m) for m in messages], add_generation_prompt))
        text = " ".join(f"<{m['role']}> {m['content']} </{m['role']}>" for m in messages)
        return text + (" <assistant>" if add_generation_prompt else "")


class CountingRunner:
    """Records its calls; its cache is a list of the tokens fed; 10 bytes a token."""

    peak_label = "fake meter"
    kv_itemsize = 2

    def __init__(self, tokenizer=None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.tokenizer = tokenizer
        self.prefilled: list[list[int]] = []  # every prompt prefilled, in order

    def _logits(self, last: int) -> np.ndarray:
        out = np.zeros(VOCAB)
        out[(last + 1) % VOCAB] = 1.0
        return out

    def prefill(self, cache: list[int], tokens: Sequence[int]) -> np.ndarray:
        self.calls.append(("prefill", len(tokens)))
        self.prefilled.append(list(tokens))
        cache.extend(tokens)
        return self._logits(tokens[-1])

    def step(self, cache: list[int], token: int) -> np.ndarray:
        self.calls.append(("step", token))
        cache.append(token)
        return self._logits(token)

    def kv_bytes(self, cache: list[int]) -> KVBytes:
        return KVBytes(held=10 * len(cache), resident=12 * len(cache))

    def raw_bytes(self, cache: list[int]) -> int:
        return 10 * len(cache)

    def reset_peak(self) -> None:
        self.calls.append(("reset_peak", 0))

    def restart_peak(self) -> None:
        pass

    def peak_bytes(self) -> int | None:
        return 4096

    def detokenize(self, tokens: Sequence[int]) -> str:
        return " ".join(map(str, tokens))


def candidate(name: str = "baseline", entered: list[str] | None = None) -> Candidate:
    @contextlib.contextmanager
    def context():
        if entered is not None:
            entered.append(name)
        yield

    return Candidate(
        name,
        "baseline" if name == "baseline" else "tier",
        "fake",
        list,
        context=context,
        details=lambda: {"seen": name},
    )


def encode_text(text: str) -> list[int]:
    """Token of each word: its length, modulo the vocabulary."""
    return [len(word) % VOCAB for word in text.split()]


class FakeBackend(Backend):
    key = "fake"
    title = "fake"
    closest_choice = "copy"
    default_choice = "copy"

    def __init__(self, max_positions: int | None = 64, tokenizer=None):
        self.runner = CountingRunner(tokenizer)
        self.max_positions = max_positions
        self.loads: list[str | None] = []

    def load(self, model: str | None) -> Loaded:
        self.loads.append(model)
        return Loaded(
            runner=self.runner,
            info={},
            encode_text=encode_text,
            encode_prompt=lambda t: [0] + encode_text(t),  # 0: the start token
            max_positions=self.max_positions,
        )

    def memory_now(self, loaded: Loaded) -> int | None:
        return 1000 + 10 * sum(1 for call in self.runner.calls if call[0] == "step")

    def chat_choices(self) -> list[str]:
        return ["copy"]

    def pair(self, loaded: Loaded, choice: str, attention: str) -> tuple[Candidate, Candidate]:
        return candidate("baseline"), candidate(choice)

    def stop_tokens(self, loaded: Loaded) -> frozenset[int]:
        return frozenset({7})
