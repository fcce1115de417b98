"""A chat tab's conversation: two histories (one per panel) and the turn that extends both.

Each panel continues its own conversation: the native side's history holds the native replies,
the compressed side's the compressed replies, as two users of the two caches would see them.

Every turn renders each side's whole conversation again (through the model's chat template when
it has one: :meth:`Backend.prompt_tokens`) and prefills it into a fresh cache, instead of keeping
the compressed cache from turn to turn and feeding it only the new turn's tokens. So every turn's
figures cover the whole conversation the cache holds, comparable from turn to turn and between
the two sides; no cache outlives its turn (the page keeps text only, and the process-wide memory
meters see the turn's own cache and nothing older); and earlier turns reach the model exactly as
its template writes them (each reply closed by the end-of-turn marker the greedy reply stopped
at). The price is a prefill that grows with the conversation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .backend import Backend, DemoError, check_fits
from .chat import generate
from .stats import SideStats, TokenMatch, token_match

__all__ = ["Setup", "Conversation", "TurnResult", "run_turn"]


@dataclass(frozen=True)
class Setup:
    """What a conversation was started with; a change starts a new conversation."""

    model: str | None
    choice: str
    attention: str = "tier"  # "tier" (each tier's own), "codes" or "materialized"


@dataclass
class Conversation:
    """Each side's history: ``{"role": "user" | "assistant", "content": text}`` dicts, oldest first."""

    setup: Setup | None = None
    native_messages: list[dict[str, str]] = field(default_factory=list)
    compressed_messages: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class TurnResult:
    native_text: str  # the replies, without the token that ended them
    compressed_text: str
    native: SideStats
    compressed: SideStats
    match: TokenMatch
    cache_name: str  # the cache actually built, as the page names it (a tier with its attention)
    native_ids: list[int]  # each side's prompt this turn (the whole conversation) + its reply
    compressed_ids: list[int]
    native_messages: list[dict[str, str]]  # each side's history after the turn
    compressed_messages: list[dict[str, str]]
    peak_meter: str  # what the peak figures measure (the runner's peak_label)


def run_turn(
    backend: Backend,
    conversation: Conversation,
    setup: Setup,
    message: str,
    new_tokens: int,
    emit: Callable[[tuple[str, str]], Any],
) -> TurnResult:
    """One turn on ``backend``'s worker thread: the native reply, then the compressed one, each
    streamed as ``emit((side, text so far))`` with side ``"native"`` or ``"compressed"``.

    The two sides run one after the other, not interleaved, because peak memory is a process-wide
    high-water mark: only a side running alone can be charged with it. ``conversation`` is not
    changed; the caller records the result.
    """
    if not message.strip():
        raise DemoError("type a message first: the prompt is empty")
    if new_tokens < 1:
        raise DemoError(f"new tokens must be at least 1; got {new_tokens}")
    loaded = backend.load(setup.model)
    native, compressed = backend.pair(loaded, setup.choice, setup.attention)
    asked = {"role": "user", "content": message}
    histories = {
        "native": [*conversation.native_messages, asked],
        "compressed": [*conversation.compressed_messages, asked],
    }
    contexts = {side: backend.prompt_tokens(loaded, history) for side, history in histories.items()}
    for side, context in contexts.items():
        check_fits(
            len(context) + new_tokens,
            loaded.max_positions,
            f"the {side} conversation plus {new_tokens} new tokens",
        )
    runner = loaded.runner
    stop = backend.stop_tokens(loaded)
    replies, stats = {}, {}
    for side, candidate in (("native", native), ("compressed", compressed)):
        tokens, side_stats = generate(
            runner,
            candidate,
            contexts[side],
            new_tokens,
            stop,
            memory_now=lambda: backend.memory_now(loaded),
            on_token=lambda so_far, side=side: emit((side, backend.reply_text(loaded, so_far, stop))),
            label="native" if side == "native" else backend.cache_label(candidate),
        )
        replies[side], stats[side] = tokens, side_stats
    texts = {side: backend.reply_text(loaded, replies[side], stop) for side in replies}
    return TurnResult(
        native_text=texts["native"],
        compressed_text=texts["compressed"],
        native=stats["native"],
        compressed=stats["compressed"],
        match=token_match(replies["native"], replies["compressed"]),
        cache_name=backend.cache_label(compressed),
        native_ids=contexts["native"] + replies["native"],
        compressed_ids=contexts["compressed"] + replies["compressed"],
        native_messages=[*histories["native"], {"role": "assistant", "content": texts["native"]}],
        compressed_messages=[
            *histories["compressed"],
            {"role": "assistant", "content": texts["compressed"]},
        ],
        peak_meter=runner.peak_label,
    )
