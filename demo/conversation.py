"""A chat tab's conversation: two histories (one per panel) and the turn that extends both.

Each panel continues its own conversation: the native side's history holds the native replies,
the compressed side's the compressed replies, as two users of the two caches would see them.
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
    materialization_free: bool


@dataclass
class Conversation:
    setup: Setup | None = None
    native_ids: list[int] = field(default_factory=list)
    compressed_ids: list[int] = field(default_factory=list)
    native_messages: list[dict[str, str]] = field(default_factory=list)
    compressed_messages: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class TurnResult:
    native_text: str
    compressed_text: str
    native: SideStats
    compressed: SideStats
    match: TokenMatch
    cache_name: str  # the cache actually built (a tier's materialization-free twin with the toggle on)
    native_ids: list[int]  # each side's whole conversation after the turn (context + reply)
    compressed_ids: list[int]
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
    native, compressed = backend.pair(loaded, setup.choice, setup.materialization_free)
    turn = backend.turn_tokens(loaded, message, first=not conversation.native_ids)
    contexts = {"native": conversation.native_ids + turn, "compressed": conversation.compressed_ids + turn}
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
            on_token=lambda so_far, side=side: emit((side, runner.detokenize(so_far))),
            label="native" if side == "native" else candidate.name,
        )
        replies[side], stats[side] = tokens, side_stats
    return TurnResult(
        native_text=runner.detokenize(replies["native"]),
        compressed_text=runner.detokenize(replies["compressed"]),
        native=stats["native"],
        compressed=stats["compressed"],
        match=token_match(replies["native"], replies["compressed"]),
        cache_name=compressed.name,
        native_ids=contexts["native"] + replies["native"],
        compressed_ids=contexts["compressed"] + replies["compressed"],
        peak_meter=runner.peak_label,
    )
