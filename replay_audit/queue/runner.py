"""The runner interface and its two implementations."""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import queue as stdlib_queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from sqlalchemy.orm import Session

from replay_audit.config import Settings
from replay_audit.db.unit_of_work import after_commit
from replay_audit.exceptions import QueueUnavailable
from replay_audit.json_value import JsonObject
from replay_audit.queue.route import DEVICE_QUEUES, LiveWorker, WorkerKind, worker_routes
from replay_audit.telemetry.log import bound
from replay_audit.telemetry.metric import job_kind, observe_job

log = logging.getLogger(__name__)

#: Seconds between retries of a failed job: RQ's `Retry(interval=...)` and the in-process runner
#: use the same schedule. Three tries after the first, then the job is failed for good.
RETRY_INTERVALS_S: Final[tuple[int, ...]] = (5, 30, 120)


#: What names the long queue of a device's queue (`gpu-long`, `cpu-long`): screenings and
#: verifications, jobs of minutes to hours, wait there so that a worker serving both takes the
#: short replay jobs of `gpu` first (RQ serves a worker's queues in order).
LONG_SUFFIX: Final = "-long"


def long_queue(name: str) -> str:
    """The long queue of queue `name` (`gpu` -> `gpu-long`)."""
    return name + LONG_SUFFIX


def served_queues(named: Sequence[str], worker: WorkerKind | None = None) -> list[str]:
    """The queues a worker told `--queue named...` serves, in order: for each device queue
    named, the queues of the routes it takes (`route.worker_routes`: its own GPU kind's, then
    any kind's, each at every TP degree up to the devices it owns: `gpu` on an A10G worker ->
    `gpu:a10g`, `gpu`), other named ones as named, then the long queue of each device queue
    named; when a long queue is named, exactly the named ones (a worker kept for long jobs)."""
    named = list(dict.fromkeys(named))
    if any(q.endswith(LONG_SUFFIX) for q in named):
        return named
    worker = worker or WorkerKind.cpu()
    out: list[str] = []
    for q in named:
        if q in DEVICE_QUEUES:
            out += [r.queue for r in worker_routes(q, worker)]
        else:
            out.append(q)
    return list(dict.fromkeys(out + [long_queue(q) for q in named if q in DEVICE_QUEUES]))


#: Seconds to connect to (or wait on) Redis before the queue counts as unreachable.
REDIS_TIMEOUT_S: Final = 3.0


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


class LongJob(Protocol):
    """A row whose job waits on a long queue (a screening, a verification)."""

    id: int
    request: JsonObject


def long_job_spec(
    func: str, kind: str, row: LongJob, timeout_s: int, default_queue: str
) -> JobSpec:
    """The one way a screening or verification (`kind`) job is named and enqueued: one naming no
    `device` goes to the deployment's default queue (`REPLAY_AUDIT_DEFAULT_QUEUE`), as a replay
    does; to its long queue (`gpu-long`: it may run for an hour, scanning or screening, and must
    not hold up the short replay jobs waiting on `gpu`)."""
    device = str(row.request.get("device"))
    return JobSpec(
        func=func,
        args=(row.id,),
        job_id=f"{kind}-{row.id}",
        queue=long_queue({"cpu": "cpu", "cuda": "gpu"}.get(device, default_queue)),
        timeout_s=timeout_s,
    )


def resolve(func: str) -> Callable[..., Any]:
    """Import `package.module.function` and return the function."""
    module, _, name = func.rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"{func} is not callable")
    return fn  # type: ignore[no-any-return]


class Runner(Protocol):
    def enqueue(self, spec: JobSpec) -> None:
        """Hand the job over; `QueueUnavailable` when the queue cannot take it."""
        ...

    def ping(self) -> None:
        """Return when the queue can take work; `QueueUnavailable` saying why otherwise."""
        ...

    def is_queued(self, job_id: str) -> bool:
        """True while the runner still holds the job (queued, running or waiting for a retry)."""
        ...


#: The stop event of the in-process runner whose thread this is (unset in other threads).
_stop_of_runner: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "replay_audit_runner_stop", default=None
)


def stop_requested() -> bool:
    """True when the runner executing the calling job is stopping (the process got Ctrl-C or
    SIGTERM). A long job checks it between units of work and returns early, leaving the rest to
    its next run: jobs are idempotent and the reconciler re-enqueues unfinished ones. Always
    False outside an in-process runner's thread (an RQ worker finishes its job first)."""
    stop = _stop_of_runner.get()
    return stop is not None and stop.is_set()


class InProcessRunner:
    """Runs jobs one at a time in a daemon thread of this process (the embedded default).

    One thread because the engine is CPU-bound and keeps its models loaded: two would only fight
    over the cores and the memory. Jobs lost when the process stops are re-enqueued by the
    reconciler at the next start, since the database still says they are unfinished.

    `stop()` ends the thread before the process exits: a daemon thread still inside torch when
    the interpreter tears down aborts the process ("terminate called without an active
    exception"). A stopped runner takes no more jobs. Whoever builds a runner owns it and
    stops it (the app's lifespan, a command's `cli.shutdown.own`): nothing process-wide keeps
    a list of runners.

    The thread runs its jobs in a copy of the context (`contextvars`) of whoever built the
    runner: what they bound there (a worker context with its loaded engines, a test's fakes)
    the jobs see, and what the jobs bind for later jobs (a worker context built on first use)
    stays with this runner, and goes with it.
    """

    def __init__(self, *, retry_scale: float = 1.0, gpu_kind: str = "cpu") -> None:
        # None wakes the thread to see the stop event.
        self._queue: stdlib_queue.Queue[JobSpec | None] = stdlib_queue.Queue()
        self._pending: set[str] = set()
        #: Jobs held without running: their route needs more devices than this process owns.
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._retry_scale = retry_scale
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._context = contextvars.copy_context()
        #: The jobs' `gpu_kind` label in the metrics (this host's device).
        self.gpu_kind = gpu_kind

    def enqueue(self, spec: JobSpec) -> None:
        with self._lock:
            if self._stop.is_set():
                log.info("runner stopped: %s left to the reconciler", spec.job_id)
                return
            if spec.job_id in self._pending or spec.job_id in self._held:
                return
            if not self.worker().serves(spec.queue):
                # A route this process cannot serve (a TP degree above its one device): the
                # job waits, held, and the run says why (`JobQueue.live_workers`).
                log.warning("job %s waits: this process cannot serve %s", spec.job_id, spec.queue)
                self._held.add(spec.job_id)
                return
            self._pending.add(spec.job_id)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._context.run,
                    args=(self._loop,),
                    name="replay-audit-runner",
                    daemon=True,
                )
                self._thread.start()
        self._queue.put(spec)

    def is_queued(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._pending or job_id in self._held

    def ping(self) -> None:
        """A thread of this process always takes work."""

    def worker(self) -> LiveWorker:
        """This runner as a worker: its host's kind, one device, every route of TP 1 (one
        process takes every GPU kind: the result's resolved arm says which ran)."""
        return LiveWorker(WorkerKind(self.gpu_kind), None)

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

    def stop(self, timeout_s: float | None = None) -> bool:
        """Take no more jobs, let the running one return (it sees `stop_requested()`), and wait
        for the thread to end. False if it is still running after `timeout_s`."""
        with self._lock:
            self._stop.set()
            thread = self._thread
        self._queue.put(None)
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                return False
        with self._lock:
            self._pending.clear()  # never to run here: `join()` must not wait for them
            self._held.clear()
        return True

    def _loop(self) -> None:
        _stop_of_runner.set(self._stop)
        while not self._stop.is_set():
            spec = self._queue.get()
            if spec is None:
                continue
            try:
                if not self._stop.is_set():
                    self._run_with_retries(spec)
            finally:
                with self._lock:
                    self._pending.discard(spec.job_id)

    def _run_with_retries(self, spec: JobSpec) -> None:
        fn = resolve(spec.func)
        kind = job_kind(spec.func)
        for attempt in range(len(spec.retry_intervals_s) + 1):
            try:
                with bound(job_id=spec.job_id), observe_job(kind, self.gpu_kind):
                    fn(*spec.args)
                return
            except Exception:
                log.exception("job %s failed (attempt %d)", spec.job_id, attempt + 1)
                if attempt == len(spec.retry_intervals_s):
                    return
                if self._stop.wait(spec.retry_intervals_s[attempt] * self._retry_scale):
                    return  # stopping: the reconciler retries it at the next start


def rq_name(settings: Settings, name: str) -> str:
    """The name RQ knows a queue, a job or the cron job by: REPLAY_AUDIT_QUEUE_PREFIX + `name`
    (the service, the workers and `rq cron` all go through here)."""
    return settings.queue_prefix + name


@contextlib.contextmanager
def _unreachable_as_unavailable() -> Iterator[None]:
    """A Redis error inside the block is `QueueUnavailable` saying so."""
    from redis.exceptions import RedisError

    try:
        yield
    except RedisError as e:
        raise QueueUnavailable(f"the job queue (Redis) is unreachable: {e}") from e


class RQRunner:
    """Sends jobs to Redis for `rq` workers (`replay-audit worker --queue gpu`). `prefix`
    (REPLAY_AUDIT_QUEUE_PREFIX) is prepended to queue names and job ids, in Redis only: specs
    and the database keep the plain names."""

    def __init__(self, redis_url: str, *, prefix: str = "") -> None:
        from redis import Redis

        # Short timeouts: an unreachable Redis is a prompt 503, not a hung request.
        self.connection = Redis.from_url(
            redis_url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S
        )
        self.prefix = prefix

    def ping(self) -> None:
        with _unreachable_as_unavailable():
            self.connection.ping()

    def enqueue(self, spec: JobSpec) -> None:
        from rq import Queue, Retry

        with _unreachable_as_unavailable():
            Queue(self.prefix + spec.queue, connection=self.connection).enqueue(
                spec.func,
                *spec.args,
                job_id=self.prefix + spec.job_id,
                job_timeout=spec.timeout_s,
                retry=Retry(max=len(spec.retry_intervals_s), interval=list(spec.retry_intervals_s)),
                result_ttl=24 * 3600,
                failure_ttl=7 * 24 * 3600,
            )

    def live_workers(self) -> list[LiveWorker]:
        """This deployment's live workers, as they announced themselves (`QueueUnavailable`
        when Redis does not answer)."""
        from replay_audit.queue.state import announced_workers

        with _unreachable_as_unavailable():
            return announced_workers(self.connection, self.prefix)

    def is_queued(self, job_id: str) -> bool:
        """Queued, deferred, scheduled for a retry, or started by a worker still alive."""
        from rq.exceptions import NoSuchJobError
        from rq.job import Job, JobStatus

        from replay_audit.queue.state import worker_alive

        try:
            job = Job.fetch(self.prefix + job_id, connection=self.connection)
            status = job.get_status()
        except NoSuchJobError:
            return False
        if status == JobStatus.STARTED and job.worker_name:
            # A started job is held while its worker lives: one SIGKILLed mid-job leaves the job
            # "started" in RQ for good, and its liveness key expires within ALIVE_TTL_S.
            return worker_alive(self.connection, self.prefix, job.worker_name)
        return status in {
            JobStatus.QUEUED,
            JobStatus.STARTED,
            JobStatus.DEFERRED,
            JobStatus.SCHEDULED,
        }


def _has_cuda_device() -> bool:
    """Whether this host has an NVIDIA GPU, asked without importing torch (the API process must
    not): the driver's proc entry, as `nvidia-smi` reads it."""
    return Path("/proc/driver/nvidia/version").exists()


def host_gpu_kind() -> str:
    """The `gpu_kind` label of jobs run beside the API (the in-process runner): `cuda` on a
    host with an NVIDIA GPU, else `cpu`. A worker names its GPU (`replay-audit worker`)."""
    return "cuda" if _has_cuda_device() else "cpu"


@dataclass(frozen=True)
class Capabilities:
    """Where this deployment's jobs run: the runner (`rq`: GPU and CPU workers elsewhere;
    `inprocess`: this process) and, for the in-process runner, whether this host has a CUDA
    device. Facts only: what a domain can run on them is the domain's rule
    (`replays.service.target_refusal`)."""

    runner: str
    cuda: bool


@dataclass(frozen=True)
class JobQueue:
    """The one way work is queued: built once at the edge (the app, a CLI command, the
    scheduler) from the settings, handed to services, which enqueue through the unit of work
    (`enqueue` buffers the job until the transaction commits and drops it on rollback)."""

    runner: Runner
    job_timeout_s: int
    capabilities: Capabilities
    #: The queue of targets that name no device (`Settings.default_queue`).
    default_queue: str = "gpu"

    def check(self) -> None:
        """`QueueUnavailable` when the queue cannot take work now (before anything is stored)."""
        self.runner.ping()

    def runs_on_cpu(self, device: str | None) -> bool:
        """Whether a job naming `device` (None: none) runs on a CPU here: named so, or sent to
        the `cpu` queue by default, or run in this process with no CUDA device."""
        if device is not None:
            return device == "cpu"
        if self.capabilities.runner == "inprocess":
            return not self.capabilities.cuda
        return self.default_queue == "cpu"

    def live_workers(self) -> list[LiveWorker] | None:
        """The workers that take this deployment's jobs now, as they announced themselves: RQ's
        live workers, or this process for the in-process runner; None where the runner cannot
        say (another runner, or Redis not answering)."""
        if isinstance(self.runner, InProcessRunner):
            return [self.runner.worker()]
        if isinstance(self.runner, RQRunner):
            try:
                return self.runner.live_workers()
            except QueueUnavailable:
                return None
        return None

    def unserved(self, queues: Iterable[str]) -> tuple[list[str], list[LiveWorker]] | None:
        """Which of `queues` no live worker serves, and the live workers (None: unknown)."""
        workers = self.live_workers()
        if workers is None:
            return None
        return [q for q in dict.fromkeys(queues) if not any(w.serves(q) for w in workers)], workers

    def enqueue(self, session: Session, specs: Sequence[JobSpec]) -> None:
        """Enqueue `specs` once `session`'s unit of work has committed (never on rollback). If
        the queue fails then, the rows stay unfinished for the reconciler and the unit of work
        records the failure (the request answers 503 saying so)."""
        specs = list(specs)

        def flush() -> None:
            for spec in specs:
                self.runner.enqueue(spec)

        after_commit(session, flush)


def build_job_queue(settings: Settings, runner: Runner | None = None) -> JobQueue:
    """The deployment's job queue from its settings (`runner`: a runner to use instead)."""
    return JobQueue(
        runner=runner or build_runner(settings),
        job_timeout_s=settings.job_timeout_s,
        capabilities=Capabilities(
            runner=settings.runner,
            cuda=settings.runner == "inprocess" and _has_cuda_device(),
        ),
        default_queue=settings.default_queue,
    )


def build_runner(settings: Settings) -> Runner:
    """A new runner of the kind the settings ask for. The caller owns it: an in-process runner
    is stopped by whoever built it (`InProcessRunner.stop`), and one process shares one by
    handing it on (`serve` gives its runner to the app and to the scheduler)."""
    if settings.runner == "rq":
        return RQRunner(settings.redis_url, prefix=settings.queue_prefix)
    return InProcessRunner(gpu_kind=host_gpu_kind())


def stop_runner(runner: Runner, timeout_s: float | None = None) -> bool:
    """Stop `runner` if it is an in-process one (its thread); False if that is still running
    after `timeout_s`. Other runners hold no thread of this process."""
    return runner.stop(timeout_s) if isinstance(runner, InProcessRunner) else True
