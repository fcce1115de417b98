"""A server in a child process for as long as a block runs: a free local port, the start, the wait
until it answers, the stop. The demo app's browser tests, palu-mlx's server test and the serving
benchmark start and reach their servers through it.

    port = free_port()
    with served([sys.executable, "-m", "demo", "--port", str(port)], f"http://127.0.0.1:{port}/",
                log_path, timeout_s=300):
        ...  # the server answers here; it is stopped when the block ends, however it ends
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["ServerError", "answers", "free_port", "served"]


class ServerError(RuntimeError):
    """The server exited before it answered, or did not answer in time; the message ends with the
    last lines of its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the operating system picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str, timeout_s: float = 5.0) -> bool:
    """Whether a GET of ``url`` returns status 200 now: False while nothing listens there, on an
    error status, a reset connection or a timeout."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except OSError:  # URLError / HTTPError, refused or reset connections, timeouts
        return False


def _log_tail(path: Path, chars: int) -> str:
    return path.read_text(errors="replace")[-chars:]


@contextmanager
def served(
    command: Sequence[str],
    url: str,
    log_path: str | os.PathLike,
    *,
    timeout_s: float,
    poll_s: float = 1.0,
    stop_timeout_s: float = 30.0,
    cwd: str | os.PathLike | None = None,
    name: str = "the server",
    log_chars: int = 4000,
) -> Iterator[subprocess.Popen]:
    """Run ``command`` (stdout and stderr into ``log_path``) until a GET of ``url`` returns 200
    (:func:`answers`, tried every ``poll_s`` seconds), then yield its process; when the block ends,
    however it ends, terminate it, and kill it if it has not exited ``stop_timeout_s`` later.

    Raises :class:`ServerError` (naming ``name``, with the log's last ``log_chars`` characters)
    when the process exits before it answers or has not answered ``timeout_s`` seconds after the
    start; the process is stopped first.
    """
    log_path = Path(log_path)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(list(command), cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise ServerError(
                    f"{name} exited with {process.returncode}:\n{_log_tail(log_path, log_chars)}"
                )
            if answers(url):
                break
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{name} did not answer within {timeout_s:g} s:\n{_log_tail(log_path, log_chars)}"
                )
            time.sleep(poll_s)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
