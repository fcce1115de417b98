"""The backends without a browser: on the embedded model (quick), a turn, a model whose every layer
slides, the comparison on a prompt and the chat template; on the default model (SmolLM2-135M-Instruct,
where it is already converted on this machine), a two-turn conversation in each tab."""

from __future__ import annotations

import pytest

from demo.app import error_message
from demo.backend import DemoError
from demo.comparison import compare_on_prompt
from demo.conversation import Conversation, Setup, run_turn

pytestmark = pytest.mark.slow

TINY = "tiny-qwen3"  # the embedded model: these tests need a model, not a good one


@pytest.fixture(scope="module")
def palu():
    from demo.palu_backend import PaluBackend

    return PaluBackend()


def turn(backend, choice: str, message: str = "The history of the Python language", new_tokens: int = 6):
    setup = Setup(model=TINY, choice=choice)
    return backend.worker.call(
        lambda: run_turn(backend, Conversation(), setup, message, new_tokens, lambda _: None)
    )


def test_a_palu_turn_measures_both_sides(palu):
    result = turn(palu, palu.default_choice)
    for side in (result.native, result.compressed):
        assert side.new_tokens == 6 and side.kv_held > 0 and side.peak_bytes and side.peak_bytes > 0
        assert side.steady_bytes is not None and len(side.step_s) == 5
    assert result.native_text and result.compressed_text


def test_a_prompt_longer_than_the_context_is_a_message(palu):
    with pytest.raises(DemoError, match="but the model allows 2048"):
        turn(palu, palu.default_choice, message="word " * 2100)


def test_a_model_path_that_does_not_exist_is_a_message(palu):
    setup = Setup(model="/nonexistent/model-dir", choice=palu.default_choice)
    with pytest.raises(ValueError) as caught:
        palu.worker.call(lambda: run_turn(palu, Conversation(), setup, "hi", 2, lambda _: None))
    assert error_message(caught.value) == (
        "**Error:** model '/nonexistent/model-dir' is neither a local directory nor a hub id like org/name"
    )


def test_the_comparison_runs_kvbench_protocol_on_the_prompt(palu):
    prompt = "The history of the Python language"
    rows, absent = palu.worker.call(
        lambda: compare_on_prompt(palu, TINY, prompt, 4, [palu.closest_choice], speed_rounds=1)
    )
    assert [r["name"] for r in rows] == ["baseline", palu.closest_choice] and absent == []
    # the scored window: the prompt, then 4 tokens of the baseline's own continuation
    assert rows[0]["kv_tokens"] == len(palu.worker.call(lambda: palu.load(TINY).encode_prompt(prompt))) + 4
    assert rows[0]["positions_scored"] == 4 and rows[0]["kl_mean"] == 0.0
    assert rows[1]["decode_tokens_per_s"] > 0 and rows[1]["kv_bytes"] > 0


def test_a_model_whose_every_layer_slides_is_served_on_coded_windows(tmp_path):
    """A model whose every layer is a sliding window: flashcodec codes the windows too, so a turn
    on it compresses (transformers' own quantized cache refuses such models)."""
    import shutil

    from kvbench.models import embedded_model_path
    from transformers import AutoConfig, AutoModelForCausalLM

    from demo.flashcodec_backend import FlashcodecBackend

    source = embedded_model_path()
    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = 2
    config.layer_types = ["sliding_attention"] * 2
    config.use_sliding_window, config.sliding_window = True, 16
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    backend = FlashcodecBackend(dtype="float32")
    setup = Setup(model=str(tmp_path), choice="jpeg-k8-int8")
    result = backend.worker.call(
        lambda: run_turn(
            backend, Conversation(), setup, "The history of the Python language", 4, lambda _: None
        )
    )
    assert result.compressed.new_tokens == 4 and 0 < result.compressed.kv_held < result.native.kv_held


def test_a_model_with_a_chat_template_gets_the_conversation_through_it(palu):
    loaded = palu.worker.call(lambda: palu.load(TINY))
    hf_tokenizer = loaded.runner.tokenizer._tokenizer  # mlx-lm's wrapper forwards to it
    assert not getattr(hf_tokenizer, "chat_template", None)  # the embedded model is a base model
    conversation = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": " and"},
        {"role": "user", "content": "more"},
    ]
    assert palu.prompt_tokens(loaded, conversation[:1]) == loaded.encode_prompt("hi there")
    assert palu.prompt_tokens(loaded, conversation) == loaded.encode_prompt("hi there and\n\nmore")
    hf_tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    try:
        assert palu.prompt_tokens(loaded, conversation) == loaded.encode_text(
            "<user>hi there<assistant> and<user>more>"
        )
    finally:
        hf_tokenizer.chat_template = None


@pytest.mark.parametrize("package", ["flashcodec", "palu"])
def test_the_default_model_holds_a_conversation(package, default_model_dir):
    """SmolLM2-135M-Instruct through its chat template: it answers, stops at its end-of-turn
    token, and the follow-up question only makes sense with the first turn in the prompt."""
    if package == "palu":
        from demo.palu_backend import PaluBackend

        backend = PaluBackend()
    else:
        from demo.flashcodec_backend import FlashcodecBackend

        backend = FlashcodecBackend()
    setup = Setup(model=None, choice=backend.closest_choice)
    loaded = backend.worker.call(lambda: backend.load(None))
    stop = backend.stop_tokens(loaded)
    assert loaded.runner.tokenizer.convert_tokens_to_ids("<|im_end|>") in stop

    def ask(conversation, question):
        return backend.worker.call(
            lambda: run_turn(backend, conversation, setup, question, 24, lambda _: None)
        )

    first = ask(Conversation(setup=setup), "What is the capital of France?")
    assert "Paris" in first.native_text and first.native_ids[-1] in stop, first.native_text
    assert "<|im_end|>" not in first.native_text
    second = ask(
        Conversation(
            setup=setup, native_messages=first.native_messages, compressed_messages=first.compressed_messages
        ),
        "And of Italy?",
    )
    prompt = loaded.runner.detokenize(second.native_ids[: second.native.context_tokens])
    assert prompt.index("Paris") < prompt.index("And of Italy?")  # the first turn is in the prompt
    assert "Rome" in second.native_text, second.native_text
