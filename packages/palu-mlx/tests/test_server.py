"""``palu-mlx server`` driven by the OpenAI client, on the embedded model, on a free localhost port."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from pathlib import Path

import pytest
from palu_helpers import palu_server

openai = pytest.importorskip("openai")

MODEL = os.environ.get("KVBENCH_EMBEDDED_MODEL") or str(
    Path(__file__).resolve().parents[3] / "benchmarks" / "model" / "tiny-qwen3"
)


def test_every_mlx_lm_server_option_is_kept():
    from palu_mlx.server import _mlx_server_parser, server_parser

    def options(parser):
        return {(s, a.default) for a in parser._actions for s in a.option_strings}

    theirs, ours = options(_mlx_server_parser()), options(server_parser())
    assert theirs and theirs <= ours
    assert {"--palu-bits", "--palu-tier", "--calibration"} <= {s for s, _ in ours}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not os.path.isdir(MODEL):
        pytest.skip(f"the embedded model is not at {MODEL}")
    log = tmp_path_factory.mktemp("server") / "server.log"
    with palu_server(MODEL, log, "--max-tokens", "12", "--palu-bits", "2") as port:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        yield client, port, log


def _chat(client, messages, stream=False, max_tokens=8):
    return client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=max_tokens, temperature=0.0, stream=stream
    )


def _streamed(client, messages) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in _chat(client, messages, stream=True):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


@pytest.mark.slow
def test_streams_a_chat_completion_with_palu_caches_batched(server):
    client, _, log = server
    text, finish = _streamed(client, [{"role": "user", "content": "What does the json module do?"}])
    assert text and finish in ("stop", "length")
    served = log.read_text()
    assert "palu KV cache: 2 code bits per element" in served
    assert "requests are served batched" in served


@pytest.mark.slow
def test_two_concurrent_conversations_and_cached_follow_ups(server):
    client, _, _ = server
    topics = ["lists and tuples", "reading files"]
    conversations = {
        i: [{"role": "user", "content": f"Explain {t} in Python, please."}] for i, t in enumerate(topics)
    }
    replies: dict[int, str] = {}
    errors: list[BaseException] = []

    def turn(i: int) -> None:
        try:
            replies[i], _ = _streamed(client, conversations[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=turn, args=(i,)) for i in conversations]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and set(replies) == set(conversations)
    for messages in conversations.values():
        first = _chat(client, messages)  # the same prompt again: served from the prompt cache
        assert first.usage.prompt_tokens_details.cached_tokens > 0
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And a short example?"},
        ]
        follow_up = _chat(client, messages)
        cached = follow_up.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < follow_up.usage.prompt_tokens
        assert cached >= first.usage.prompt_tokens  # the whole earlier exchange was reused


def _raw_post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, response.read()


@pytest.mark.slow
def test_malformed_requests_get_mlx_lm_errors_and_the_server_keeps_serving(server):
    client, port, _ = server
    assert _raw_post(port, "/v1/chat/completions", b"{not json")[0] == 400
    assert _raw_post(port, "/v1/chat/completions", b"[1, 2]")[0] == 400
    assert _raw_post(port, "/v1/nowhere", b"{}")[0] == 404
    status, _ = _raw_post(port, "/v1/chat/completions", json.dumps({"messages": "not a list"}).encode())
    assert status >= 400
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model="default_model", messages=[], max_tokens=-3)
    reply = _chat(client, [{"role": "user", "content": "Still there?"}])
    assert reply.choices[0].message.content is not None


@pytest.mark.slow
def test_a_client_leaving_mid_stream_leaves_the_server_serving(server):
    client, port, _ = server
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 400, "stream": True}
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        received = b""
        while b"data:" not in received:
            chunk = sock.recv(4096)
            assert chunk, "the server closed the stream before sending a token"
            received += chunk
    # the socket is closed with hundreds of tokens still to come
    text, finish = _streamed(client, [{"role": "user", "content": "Hello again."}])
    assert finish in ("stop", "length")
