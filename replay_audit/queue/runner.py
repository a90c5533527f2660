"""The runner interface and its two implementations."""

from __future__ import annotations

import importlib
import logging
import queue as stdlib_queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from replay_audit.config import Settings

log = logging.getLogger(__name__)

#: Seconds between retries of a failed job: RQ's `Retry(interval=...)` and the in-process runner
#: use the same schedule. Three tries after the first, then the job is failed for good.
RETRY_INTERVALS_S: Final[tuple[int, ...]] = (5, 30, 120)


@dataclass(frozen=True)
class JobSpec:
    """What to run: a dotted function path and its (id-only) arguments."""

    func: str
    args: tuple[str | int, ...]
    #: Deterministic id: enqueuing the same piece of work twice is one job, not two.
    job_id: str
    queue: str = "gpu"
    timeout_s: int = 3600
    retry_intervals_s: Sequence[int] = field(default=RETRY_INTERVALS_S)


def resolve(func: str) -> Callable[..., Any]:
    """Import `package.module.function` and return the function."""
    module, _, name = func.rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"{func} is not callable")
    return fn  # type: ignore[no-any-return]


class Runner(Protocol):
    def enqueue(self, spec: JobSpec) -> None: ...

    def is_queued(self, job_id: str) -> bool:
        """True while the runner still holds the job (queued, running or waiting for a retry)."""
        ...


class InProcessRunner:
    """Runs jobs one at a time in a daemon thread of this process (the embedded default).

    One thread because the engine is CPU-bound and keeps its models loaded: two would only fight
    over the cores and the memory. Jobs lost when the process stops are re-enqueued by the
    reconciler at the next start, since the database still says they are unfinished.
    """

    def __init__(self, *, retry_scale: float = 1.0) -> None:
        self._queue: stdlib_queue.Queue[JobSpec] = stdlib_queue.Queue()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._retry_scale = retry_scale
        self._thread: threading.Thread | None = None

    def enqueue(self, spec: JobSpec) -> None:
        with self._lock:
            if spec.job_id in self._pending:
                return
            self._pending.add(spec.job_id)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="replay-audit-runner", daemon=True
                )
                self._thread.start()
        self._queue.put(spec)

    def is_queued(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._pending

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait until every enqueued job has finished (tests, the demo). False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                if not self._pending:
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def _loop(self) -> None:
        while True:
            spec = self._queue.get()
            try:
                self._run_with_retries(spec)
            finally:
                with self._lock:
                    self._pending.discard(spec.job_id)

    def _run_with_retries(self, spec: JobSpec) -> None:
        fn = resolve(spec.func)
        for attempt in range(len(spec.retry_intervals_s) + 1):
            try:
                fn(*spec.args)
                return
            except Exception:
                log.exception("job %s failed (attempt %d)", spec.job_id, attempt + 1)
                if attempt == len(spec.retry_intervals_s):
                    return
                time.sleep(spec.retry_intervals_s[attempt] * self._retry_scale)


class RQRunner:
    """Sends jobs to Redis for `rq` workers (`replay-audit worker --queue gpu`)."""

    def __init__(self, redis_url: str) -> None:
        from redis import Redis

        self.connection = Redis.from_url(redis_url)

    def enqueue(self, spec: JobSpec) -> None:
        from rq import Queue, Retry

        Queue(spec.queue, connection=self.connection).enqueue(
            spec.func,
            *spec.args,
            job_id=spec.job_id,
            job_timeout=spec.timeout_s,
            retry=Retry(max=len(spec.retry_intervals_s), interval=list(spec.retry_intervals_s)),
            result_ttl=24 * 3600,
            failure_ttl=7 * 24 * 3600,
        )

    def is_queued(self, job_id: str) -> bool:
        from rq.exceptions import NoSuchJobError
        from rq.job import Job, JobStatus

        try:
            status = Job.fetch(job_id, connection=self.connection).get_status()
        except NoSuchJobError:
            return False
        return status in {
            JobStatus.QUEUED,
            JobStatus.STARTED,
            JobStatus.DEFERRED,
            JobStatus.SCHEDULED,
        }


_inprocess: InProcessRunner | None = None
_inprocess_lock = threading.Lock()


def get_runner(settings: Settings) -> Runner:
    """The runner the settings ask for. The in-process one is a per-process singleton."""
    global _inprocess
    if settings.runner == "rq":
        return RQRunner(settings.redis_url)
    with _inprocess_lock:
        if _inprocess is None:
            _inprocess = InProcessRunner()
        return _inprocess
