"""One thread per framework: every model call of a backend runs on it.

MLX ties its arrays to the thread that made them ("There is no Stream(cpu, 0) in current
thread" when another thread touches them), while Gradio runs each step of a streaming handler on
whichever worker thread is free. So a backend loads its model and runs every turn on its own
single thread; handlers submit jobs and stream what the job emits.

Jobs of all workers also run one at a time: the memory meters are process-wide (Linux VmHWM and
RSS count MLX's memory too), so a turn measured while another model works would be charged with
its memory. A visitor's turn waits for the one running.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["ModelWorker"]

T = TypeVar("T")
_DONE = object()
_ONE_AT_A_TIME = threading.Lock()  # shared by every worker: see the module docstring


class ModelWorker:
    """A single thread that runs jobs in order."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"demo-{name}")

    def call(self, job: Callable[[], T]) -> T:
        """Run ``job`` on the worker thread and return its result (or raise its exception)."""
        return self._submit(job).result()

    def stream(self, job: Callable[[Callable[[Any], None]], T]) -> Iterator[Any]:
        """Run ``job(emit)`` on the worker thread and yield each item it emits as it emits it;
        then yield the job's return value (or raise its exception)."""
        items: queue.Queue[Any] = queue.Queue()

        def run() -> T:
            try:
                return job(items.put)
            finally:
                items.put(_DONE)

        future = self._submit(run)
        while (item := items.get()) is not _DONE:
            yield item
        yield future.result()

    def _submit(self, job: Callable[[], T]) -> Future[T]:
        def alone() -> T:
            with _ONE_AT_A_TIME:
                return job()

        # the caller's context (Gradio's progress tracker lives in a context variable) goes along
        return self._pool.submit(contextvars.copy_context().run, alone)
