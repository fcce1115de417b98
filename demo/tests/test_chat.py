"""One side of a turn (``generate``) and a whole turn (``run_turn``, its prompt and stop tokens) on a
fake runner."""

from __future__ import annotations

import pytest

from demo.backend import Backend, DemoError, model_key
from demo.chat import generate
from demo.conversation import Conversation, Setup, run_turn

from .fakes import ChatTokenizer, CountingRunner, FakeBackend, candidate, encode_text


def encode_prompt(text: str) -> list[int]:
    return [0, *encode_text(text)]


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
    setup = Setup(model=None, choice="copy")
    result = run_turn(backend, Conversation(setup=setup), setup, "ab cde", 3, events.append)
    sides = [side for side, _ in events]
    assert sides == ["native"] * 3 + ["compressed"] * 3  # one after the other, never interleaved
    assert result.native_ids == [0, 2, 3, 4, 5, 6] == result.compressed_ids
    assert result.native_text == "4 5 6" and result.match.share == 1.0
    assert result.compressed.name == "copy" and result.native.name == "native"
    assert result.native_messages == [
        {"role": "user", "content": "ab cde"},
        {"role": "assistant", "content": "4 5 6"},
    ]

    later = Conversation(
        setup=setup, native_messages=result.native_messages, compressed_messages=result.compressed_messages
    )
    again = run_turn(backend, later, setup, "x", 2, lambda _: None)
    # without a chat template the history is plain text: each reply continues its message, a new
    # message opens a paragraph; one start token for the whole conversation
    assert backend.runner.prefilled[-1] == encode_prompt("ab cde" + "4 5 6" + "\n\n" + "x")
    assert again.native_messages[:2] == result.native_messages


def test_a_chat_template_renders_the_whole_conversation_each_turn():
    tokenizer = ChatTokenizer()
    backend = FakeBackend(tokenizer=tokenizer)
    setup = Setup(model=None, choice="copy")
    first = run_turn(
        backend, Conversation(setup=setup), setup, "What is the capital of France?", 3, lambda _: None
    )
    asked = {"role": "user", "content": "What is the capital of France?"}
    # both sides rendered through the template, the assistant's turn opened
    assert tokenizer.rendered == [([asked], True), ([asked], True)]
    rendered = "<user> What is the capital of France? </user> <assistant>"
    assert backend.runner.prefilled[0] == encode_text(
        rendered
    )  # no start token added: the template has its own

    # a later turn sends each side's earlier turns too, with that side's own reply
    own = [asked, {"role": "assistant", "content": "compressed said this"}]
    later = Conversation(setup=setup, native_messages=first.native_messages, compressed_messages=own)
    run_turn(backend, later, setup, "And of Italy?", 2, lambda _: None)
    follow_up = {"role": "user", "content": "And of Italy?"}
    native_turn, compressed_turn = tokenizer.rendered[-2:]
    assert native_turn == ([asked, {"role": "assistant", "content": first.native_text}, follow_up], True)
    assert compressed_turn == ([*own, follow_up], True)
    expected = "<user> What is the capital of France? </user> <assistant> compressed said this </assistant>"
    assert backend.runner.prefilled[-1] == encode_text(f"{expected} <user> And of Italy? </user> <assistant>")


def test_a_reply_ends_at_the_end_of_turn_token_which_the_history_leaves_out():
    backend = FakeBackend(tokenizer=ChatTokenizer())
    setup = Setup(model=None, choice="copy")
    streamed = []
    # the prompt ends with the template's "<assistant>", token 3: the reply is 4 5 6, then 7 (the
    # fake's end-of-turn token) stops it
    result = run_turn(backend, Conversation(setup=setup), setup, "abcde", 10, streamed.append)
    assert result.native_ids[-4:] == [4, 5, 6, 7] and result.native.new_tokens == 4  # the stop token counts
    assert result.native_text == "4 5 6"
    assert result.native_messages[-1] == {"role": "assistant", "content": "4 5 6"}
    assert [text for side, text in streamed if side == "native"][-2:] == ["4 5 6", "4 5 6"]


def test_stop_tokens_are_the_tokenizer_and_generation_config_end_ids(tmp_path):
    backend = FakeBackend(tokenizer=ChatTokenizer())  # eos_token_id 7
    loaded = backend.load(None)
    assert Backend.stop_tokens(backend, loaded) == {7}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    loaded.info["source"] = str(tmp_path)  # mlx-lm keeps no generation config: the model's file
    assert Backend.stop_tokens(backend, loaded) == {2, 7}
    loaded.runner.tokenizer.eos_token_ids = {3}  # mlx-lm's wrapper: a set
    assert Backend.stop_tokens(backend, loaded) == {2, 3, 7}


def test_an_empty_model_field_is_the_default_model():
    from kvbench.models import DEFAULT_MODEL

    assert model_key(None) == model_key("  ") == DEFAULT_MODEL == "smollm2-135m"
    assert model_key(" tiny-qwen3 ") == "tiny-qwen3"


def test_user_mistakes_are_messages_not_crashes():
    backend = FakeBackend(max_positions=8)
    setup = Setup(model=None, choice="copy")
    with pytest.raises(DemoError, match="prompt is empty"):
        run_turn(backend, Conversation(), setup, "  \n", 4, lambda _: None)
    with pytest.raises(DemoError, match="needs 10 positions but the model allows 8"):
        run_turn(backend, Conversation(), setup, "a b c d e", 4, lambda _: None)
    assert backend.runner.calls == []  # refused before any model call
