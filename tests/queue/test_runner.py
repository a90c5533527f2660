"""The in-process runner stops: the running job sees `stop_requested()` and returns, nothing more
runs, and nobody waits forever on jobs that will never run here. (`stop_inprocess_runners()`,
which stops every runner of the process, is tested through real processes in
tests/cli/test_interrupt.py: here it would stop the other tests' runners.)"""

from __future__ import annotations

import threading
import time

from replay_audit.queue import JobSpec, stop_requested
from replay_audit.queue.runner import InProcessRunner

started = threading.Event()
ran: list[str] = []


def long_job(name: str) -> None:
    """Works in small steps until its runner stops (at most 30 s)."""
    ran.append(name)
    started.set()
    deadline = time.monotonic() + 30
    while not stop_requested() and time.monotonic() < deadline:
        time.sleep(0.01)


def _spec(name: str) -> JobSpec:
    return JobSpec(func=f"{__name__}.long_job", args=(name,), job_id=name)


def test_stop_ends_the_running_job_and_runs_nothing_more() -> None:
    started.clear()
    ran.clear()
    runner = InProcessRunner()
    runner.enqueue(_spec("first"))
    runner.enqueue(_spec("second"))
    assert started.wait(10)
    assert not stop_requested()  # only the runner's own thread is told

    t0 = time.monotonic()
    assert runner.stop(timeout_s=10)
    assert time.monotonic() - t0 < 5
    assert ran == ["first"]
    assert not runner.is_queued("second") and runner.join(timeout_s=1)

    runner.enqueue(_spec("third"))  # a stopped runner takes nothing more
    time.sleep(0.2)
    assert ran == ["first"] and not runner.is_queued("third")
