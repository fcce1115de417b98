"""Jobs run in order on one thread (MLX arrays stay on the thread that made them)."""

from __future__ import annotations

import threading

import pytest

from demo.worker import ModelWorker


def test_every_job_runs_on_the_same_thread_not_the_callers():
    worker = ModelWorker("test")
    threads = {worker.call(lambda: threading.get_ident()) for _ in range(5)}
    threads |= {item for item in worker.stream(lambda emit: emit(threading.get_ident())) if item is not None}
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_stream_yields_each_emitted_item_then_the_result():
    worker = ModelWorker("test")

    def job(emit):
        for i in range(3):
            emit(("token", i))
        return "done"

    assert list(worker.stream(job)) == [("token", 0), ("token", 1), ("token", 2), "done"]


def test_a_failing_job_raises_in_the_caller_and_the_worker_keeps_serving():
    worker = ModelWorker("test")

    def job(emit):
        emit("partial")
        raise ValueError("bad prompt")

    stream = worker.stream(job)
    assert next(stream) == "partial"
    with pytest.raises(ValueError, match="bad prompt"):
        next(stream)
    assert worker.call(lambda: 41 + 1) == 42


def test_jobs_of_different_workers_never_overlap():
    # the memory meters are process-wide: a job measured while another runs would be charged for it
    first, second = ModelWorker("a"), ModelWorker("b")
    running, overlaps = [], []
    lock = threading.Lock()
    release = threading.Event()

    def job(name):
        def run():
            with lock:
                running.append(name)
                if len(running) > 1:
                    overlaps.append(tuple(running))
            release.wait(0.2)
            with lock:
                running.remove(name)
            return name

        return run

    futures = [w._submit(job(n)) for w, n in ((first, "a"), (second, "b"), (first, "c"), (second, "d"))]
    assert sorted(f.result(timeout=10) for f in futures) == ["a", "b", "c", "d"]
    assert overlaps == []
