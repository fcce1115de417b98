"""kvbench.process: a child-process server reached on a free port, waited for, and always stopped."""

from __future__ import annotations

import sys

import pytest
from kvbench.process import ServerError, answers, free_port, served


def test_a_server_is_yielded_once_it_answers_and_stopped_after_the_block(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    assert not answers(url)  # nothing listens on a free port
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with served(command, url, tmp_path / "server.log", timeout_s=30, poll_s=0.1, cwd=tmp_path) as process:
        assert process.poll() is None and answers(url)
    assert process.poll() is not None and not answers(url)


def test_an_error_status_is_not_an_answer(tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with served(
        command, f"http://127.0.0.1:{port}/", tmp_path / "log", timeout_s=30, poll_s=0.1, cwd=tmp_path
    ):
        assert not answers(f"http://127.0.0.1:{port}/no-such-file")  # 404


def test_a_server_that_exits_first_is_an_error_with_its_log(tmp_path):
    command = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    url = f"http://127.0.0.1:{free_port()}/"
    with pytest.raises(ServerError, match=r"(?s)the demo exited with 3:\n.*no model here"):
        with served(command, url, tmp_path / "log", timeout_s=30, poll_s=0.1, name="the demo"):
            pytest.fail("the block ran")


def test_a_server_that_never_answers_is_stopped_after_the_timeout(tmp_path):
    command = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    url = f"http://127.0.0.1:{free_port()}/"
    with pytest.raises(ServerError, match=r"(?s)the server did not answer within 0\.5 s:\n.*loading"):
        with served(command, url, tmp_path / "log", timeout_s=0.5, poll_s=0.1, stop_timeout_s=5):
            pytest.fail("the block ran")
