"""One side of a turn (``generate``) and a whole turn (``run_turn``) on a fake runner."""

from __future__ import annotations

import pytest

from demo.backend import DemoError
from demo.chat import generate
from demo.conversation import Conversation, Setup, run_turn

from .fakes import CountingRunner, FakeBackend, candidate


def test_generate_prefills_once_then_one_call_per_token_and_reads_the_meters():
    runner, entered, streamed = CountingRunner(), [], []
    readings = iter([500, 800])
    tokens, stats = generate(
        runner, candidate("t", entered), [1, 2], 4, frozenset(), lambda: next(readings), streamed.append
    )
    assert tokens == [3, 4, 5, 6]
    # the last token is not fed: nothing would read its logits
    assert runner.calls == [("reset_peak", 0), ("prefill", 2), ("step", 3), ("step", 4), ("step", 5)]
    assert streamed == [[3], [3, 4], [3, 4, 5], [3, 4, 5, 6]]
    assert entered == ["t"] and stats.details == {"seen": "t"}
    assert (stats.context_tokens, stats.new_tokens) == (2, 4)
    assert (stats.kv_held, stats.kv_resident) == (50, 60)  # 2 + 3 tokens in the cache
    assert (stats.peak_bytes, stats.steady_bytes) == (4096, 300)
    assert len(stats.step_s) == 3 and all(s >= 0 for s in stats.step_s) and stats.prefill_s >= 0


def test_generate_stops_at_a_stop_token_and_keeps_it():
    tokens, stats = generate(
        CountingRunner(), candidate(), [4], 10, frozenset({6}), lambda: None, lambda _: None
    )
    assert tokens == [5, 6] and stats.new_tokens == 2 and stats.steady_bytes is None


def test_a_turn_runs_native_then_compressed_and_extends_both_histories():
    backend = FakeBackend()
    events = []
    setup = Setup(model=None, choice="copy", materialization_free=False)
    result = run_turn(backend, Conversation(setup=setup), setup, "ab cde", 3, events.append)
    sides = [side for side, _ in events]
    assert sides == ["native"] * 3 + ["compressed"] * 3  # one after the other, never interleaved
    assert result.native_ids == [0, 2, 3, 4, 5, 6] == result.compressed_ids
    assert result.native_text == "4 5 6" and result.match.share == 1.0
    assert result.compressed.name == "copy" and result.native.name == "native"

    later = Conversation(setup=setup, native_ids=result.native_ids, compressed_ids=result.compressed_ids)
    again = run_turn(backend, later, setup, "x", 2, lambda _: None)
    # a later turn continues each side's own history; plain text, no second start token
    assert again.native_ids[: len(result.native_ids) + 1] == [*result.native_ids, 1]


def test_user_mistakes_are_messages_not_crashes():
    backend = FakeBackend(max_positions=8)
    setup = Setup(model=None, choice="copy", materialization_free=False)
    with pytest.raises(DemoError, match="prompt is empty"):
        run_turn(backend, Conversation(), setup, "  \n", 4, lambda _: None)
    with pytest.raises(DemoError, match="needs 10 positions but the model allows 8"):
        run_turn(backend, Conversation(), setup, "a b c d e", 4, lambda _: None)
    assert backend.runner.calls == []  # refused before any model call
