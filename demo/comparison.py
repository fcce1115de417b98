"""The Full comparison tab: kvbench's protocol (:func:`kvbench.protocol.measure`) on the user's prompt.

The protocol needs a text to score teacher-forced and prompts to continue greedily; here both come
from the prompt: the window is the prompt followed by the uncompressed model's own greedy
continuation (so the NLL, KL and top-1 figures say how far each cache strays from what the
uncompressed model would write), and the greedy prompt is the prompt itself. Everything measured
is measured by ``measure``, with the caches the package's harness builds, as ``<package> compare``
does on held-out text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbench.protocol import Settings, measure

from .backend import Backend, DemoError, check_fits
from .chat import generate

__all__ = ["compare_on_prompt"]


def compare_on_prompt(
    backend: Backend,
    model: str | None,
    prompt: str,
    new_tokens: int,
    names: Sequence[str],
    speed_rounds: int = 2,
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Rows of :func:`kvbench.protocol.measure` (baseline first, then ``names`` in registry
    order) and the chosen peers that cannot run here. Runs on ``backend``'s worker thread;
    its tqdm progress is what the page's progress bar follows."""
    if not prompt.strip():
        raise DemoError("type a prompt first: the prompt is empty")
    if not names:
        raise DemoError("pick at least one cache to compare with the uncompressed one")
    if new_tokens < 2:
        raise DemoError(f"new tokens must be at least 2 (scored positions); got {new_tokens}")
    loaded = backend.load(model)
    tokens = loaded.encode_prompt(prompt)
    check_fits(
        len(tokens) + new_tokens,
        loaded.max_positions,
        f"the prompt ({len(tokens)} tokens) plus {new_tokens} new tokens",
    )
    candidates, absent = backend.candidates(loaded, names)
    continuation, _ = generate(
        loaded.runner,
        candidates[0],
        tokens,
        new_tokens,
        stop_tokens=frozenset(),  # score a full-length continuation even past an end-of-text token
        memory_now=lambda: None,
        on_token=lambda _: None,
    )
    settings = Settings(
        windows=1,
        context_tokens=len(tokens),
        scored_tokens=new_tokens,
        new_tokens=new_tokens,
        speed_rounds=speed_rounds,
        speed_steps=new_tokens,
        prompt_count=1,
    )
    rows = measure(loaded.runner, candidates, [tokens + continuation], [tokens], settings, progress=True)
    return rows, absent
