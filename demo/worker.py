"""One thread per framework: every model call of a backend runs on it.

MLX ties its arrays to the thread that made them ("There is no Stream(cpu, 0) in current
thread" when another thread touches them), while Gradio runs each step of a streaming handler on
whichever worker thread is free. So a backend loads its model and runs every turn on its own
single thread; handlers submit jobs and stream what the job emits. One thread also means one
turn at a time per model, so two visitors never share a cache meter's window.
"""

from __future__ import annotations

import contextvars
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["ModelWorker"]

T = TypeVar("T")
_DONE = object()


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
        # the caller's context (Gradio's progress tracker lives in a context variable) goes along
        return self._pool.submit(contextvars.copy_context().run, job)
