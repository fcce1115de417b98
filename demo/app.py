"""The Gradio page: a chat tab per package and the Full comparison tab.

Layout and wiring only. What a turn does is :mod:`demo.conversation`, what the comparison does is
:mod:`demo.comparison`; both run on the backend's own thread (:mod:`demo.worker`). A mistake the
user can fix shows as a message under the panels, and the page keeps serving.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

import gradio as gr
import pandas as pd
from kvbench.models import DEFAULT_MODEL, model_names
from kvspec import KVSpecError

from .backend import Backend, DemoError, model_key
from .charts import comparison_figure
from .comparison import compare_on_prompt
from .conversation import Conversation, Setup, TurnResult, run_turn
from .formatting import (
    COMPARISON_HEADERS,
    STATS_HEADERS,
    comparison_rows,
    details_line,
    match_line,
    stats_rows,
)

__all__ = ["build_app", "error_message"]

# the page must not reach the network for fonts (the demo runs offline): system fonts only
THEME = gr.themes.Default(
    font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
)

INTRO = """\
# kv-codecs: side-by-side chat

Left: the model with its uncompressed KV cache. Right: the same model with a compressed cache.
Both panels stream their tokens as they are generated (left first, then right: each side runs
alone so its peak memory is its own). Every number under them is measured in that turn. Each
panel keeps its own conversation: every turn sends the model that side's earlier turns too,
through the model's chat template.
"""

STATS_NOTE = """\
**KV held**: bytes of the cache's arrays after the turn (its compressed form); **KV resident**:
everything the cache object keeps (held + spare capacity and decoded views). **peak memory**:
high-water mark during the turn above the level before the cache existed; **steady memory**: in
use after the turn with the cache alive, above the same level ({meter}). **per token**: median
wall time of a one-token call. **token match**: positions where the right reply's token equals
the left one's.
"""


def error_message(err: BaseException) -> str:
    """The page's text for an exception: the message alone for a mistake the user can fix
    (DemoError, or the packages' KVSpecError such as a model path that does not exist), the type
    too for anything else."""
    if isinstance(err, (DemoError, KVSpecError)):
        # the harnesses' messages name their command-line option; here it is the Model field
        text = " ".join(str(err).split()).replace("--model", "model")
    else:
        text = f"unexpected {type(err).__name__}: {' '.join(str(err).split())}"
    return f"**Error:** {text}"


def _report(err: BaseException) -> str:
    if not isinstance(err, (DemoError, KVSpecError)):
        traceback.print_exception(err, file=sys.stderr)
    return error_message(err)


def _table(rows: list[list[str]], headers: Sequence[str]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(headers))


def _model_label() -> str:
    return (
        f"Model (a named model: {', '.join(model_names())}; a local directory or a cached hub id; "
        f"empty: {DEFAULT_MODEL})"
    )


# ---------------------------------------------------------------------------- chat tab
def _chat_tab(backend: Backend, default_model: str | None) -> None:
    key = backend.key
    with gr.Row():
        model = gr.Textbox(
            value=model_key(default_model), label=_model_label(), elem_id=f"{key}-model", scale=3
        )
        choice = gr.Dropdown(
            choices=backend.chat_choices(),
            value=backend.default_choice,
            label="Compressed cache (right panel)",
            elem_id=f"{key}-cache",
            scale=2,
        )
        if backend.attention_choices:
            attention = gr.Radio(
                choices=[(label, value) for value, label in backend.attention_choices],
                value=backend.default_attention,
                label="attention",
                info="on the stored codes (no decoded K/V view) or on a decoded view",
                elem_id=f"{key}-attention",
                scale=2,
            )
        else:
            attention = gr.State(backend.default_attention)
        new_tokens = gr.Slider(
            # a reply ends earlier at the model's end-of-turn token
            1,
            256,
            value=64,
            step=1,
            label="new tokens (at most)",
            elem_id=f"{key}-new-tokens",
            scale=2,
        )
    gr.Markdown(f"Precision: {backend.precision_note()}.", elem_id=f"{key}-precision")
    with gr.Row():
        left = gr.Chatbot(label="native cache", elem_id=f"{key}-native", height=320)
        right = gr.Chatbot(label="compressed cache", elem_id=f"{key}-compressed", height=320)
    message = gr.Textbox(
        label="Message", placeholder="Type a prompt and press Enter", elem_id=f"{key}-message"
    )
    with gr.Row():
        send = gr.Button("Send", variant="primary", elem_id=f"{key}-send")
        clear = gr.Button("Clear", elem_id=f"{key}-clear")
    status = gr.Markdown(elem_id=f"{key}-status")
    stats = gr.Dataframe(
        value=_table([], STATS_HEADERS),
        label="this turn",
        interactive=False,
        elem_id=f"{key}-stats",
        wrap=True,
    )
    note = gr.Markdown(STATS_NOTE.format(meter="measured with the runner's meter"), elem_id=f"{key}-note")
    state = gr.State(None)

    def respond(
        text: str, model_text: str, picked: str, attends: str, count: float, conv: Conversation | None
    ):
        setup = Setup(model=model_key(model_text), choice=picked, attention=attends)
        notice = ""
        if conv is None or conv.setup != setup:
            if conv is not None and conv.native_messages:
                notice = "New conversation: the model or the cache changed. "
            conv = Conversation(setup=setup)
        shown_left = [
            *conv.native_messages,
            {"role": "user", "content": text},
            {"role": "assistant", "content": ""},
        ]
        shown_right = [
            *conv.compressed_messages,
            {"role": "user", "content": text},
            {"role": "assistant", "content": ""},
        ]
        try:
            job = lambda emit: run_turn(backend, conv, setup, text, int(count), emit)  # noqa: E731
            for item in backend.worker.stream(job):
                if isinstance(item, TurnResult):
                    break
                side, so_far = item
                (shown_left if side == "native" else shown_right)[-1]["content"] = so_far
                yield {left: shown_left, right: shown_right, status: f"{notice}generating ({side}) ..."}
        except Exception as err:  # noqa: BLE001 - every failure becomes a message; the page keeps serving
            yield {
                left: conv.native_messages,
                right: conv.compressed_messages,
                status: _report(err),
                state: conv,
            }
            return
        result = item
        details = details_line(result.compressed.details)
        details = f" {result.cache_name}: {details}." if details else ""
        # the panels show what the next turn sends: the replies without their end-of-turn token
        shown_left = [dict(m) for m in result.native_messages]
        shown_right = [dict(m) for m in result.compressed_messages]
        yield {
            left: shown_left,
            right: gr.Chatbot(value=shown_right, label=f"compressed cache: {result.cache_name}"),
            stats: _table(stats_rows(result.native, result.compressed, result.match), STATS_HEADERS),
            status: f"{notice}Turn {len(shown_left) // 2}: {match_line(result.match)}{details}",
            state: Conversation(
                setup=setup,
                native_messages=result.native_messages,
                compressed_messages=result.compressed_messages,
            ),
            message: "",
            note: STATS_NOTE.format(meter=result.peak_meter),
        }

    def reset():
        return [], gr.Chatbot(value=[], label="compressed cache"), _table([], STATS_HEADERS), "", None

    outputs = [left, right, stats, status, state, message, note]
    inputs = [message, model, choice, attention, new_tokens, state]
    send.click(respond, inputs, outputs)
    message.submit(respond, inputs, outputs)
    clear.click(reset, None, [left, right, stats, status, state])


# ---------------------------------------------------------------------------- comparison tab
def _comparison_tab(backends: dict[str, Backend], default_model: str | None) -> None:
    first = next(iter(backends.values()))
    with gr.Row():
        package = gr.Radio(list(backends), value=first.key, label="Package", elem_id="cmp-package", scale=1)
        model = gr.Textbox(value=model_key(default_model), label=_model_label(), elem_id="cmp-model", scale=3)
        new_tokens = gr.Slider(
            2,
            256,
            value=16,
            step=1,
            label="new tokens (scored and greedy)",
            elem_id="cmp-new-tokens",
            scale=2,
        )
    names = gr.CheckboxGroup(
        choices=first.tier_names() + first.peer_names(),
        value=first.tier_names() + first.peer_names(),
        label="Caches beside the uncompressed baseline",
        elem_id="cmp-caches",
    )
    prompt = gr.Textbox(label="Prompt", lines=3, elem_id="cmp-prompt")
    run = gr.Button("Run comparison", variant="primary", elem_id="cmp-run")
    status = gr.Markdown(elem_id="cmp-status")
    plot = gr.Plot(label="bars", elem_id="cmp-plot")
    table = gr.Dataframe(
        value=_table([], COMPARISON_HEADERS), interactive=False, elem_id="cmp-table", wrap=True
    )

    def pick(key: str):
        everything = backends[key].tier_names() + backends[key].peer_names()
        return gr.CheckboxGroup(choices=everything, value=everything)

    def compare(
        key: str,
        model_text: str,
        count: float,
        chosen: list[str],
        text: str,
        progress=gr.Progress(track_tqdm=True),  # noqa: B008 - Gradio injects progress through this default
    ):
        backend = backends[key]
        progress(0.0, desc="loading the model")
        try:
            rows, absent = backend.worker.call(
                lambda: compare_on_prompt(backend, model_text.strip() or None, text, int(count), chosen)
            )
        except Exception as err:  # noqa: BLE001 - every failure becomes a message; the page keeps serving
            return None, _table([], COMPARISON_HEADERS), _report(err)
        lines = [
            f"kvbench protocol on your prompt: {rows[0]['kv_tokens']} tokens (prompt + the uncompressed "
            f"model's greedy continuation, scored teacher-forced); {len(rows)} caches. x: ratio to the "
            "uncompressed cache's K/V cut to the tokens held (a cache that grows in steps, like mlx-lm's "
            "256-token blocks, holds more than that on a short prompt); d ppl: perplexity increase; KL: "
            "mean KL(baseline || cache) per position."
        ]
        lines += [f"Not run: {a['name']} ({a['reason']})" for a in absent]
        return comparison_figure(rows), _table(comparison_rows(rows), COMPARISON_HEADERS), "\n\n".join(lines)

    package.change(pick, package, names)
    run.click(compare, [package, model, new_tokens, names, prompt], [plot, table, status])


# ---------------------------------------------------------------------------- page
def build_app(backends: Sequence[Backend], default_model: str | None = None) -> gr.Blocks:
    """The page for ``backends`` (one chat tab each, in order, then the comparison tab)."""
    by_key = {b.key: b for b in backends}
    with gr.Blocks(title="kv-codecs chat", analytics_enabled=False) as app:
        gr.Markdown(INTRO)
        for backend in backends:
            with gr.Tab(backend.title, elem_id=f"tab-{backend.key}"):
                _chat_tab(backend, default_model)
        with gr.Tab("Full comparison", elem_id="tab-comparison"):
            _comparison_tab(by_key, default_model)
    return app
