"""What a worker process keeps between jobs (`WorkerContext`: its settings and its loaded
engines), bound per thread or runner, never process-wide: `replay-audit worker` binds its own in
the thread its RQ `SimpleWorker` runs jobs in, and the tests bind theirs; an in-process runner's
first job builds one from the environment, which its thread keeps (see
`queue.runner.InProcessRunner`) for as long as the runner lives. Every job (replays,
screenings, verifications, audits) takes its engines from the context's pool, the one engine
seam: tests bind a pool with a fake loader.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Final

from replay_audit.config import Settings
from replay_audit.engine.pool import EnginePool
from replay_audit.queue import host_gpu_kind
from replay_audit.telemetry.metric import MODEL_LOADS

#: Engines a worker keeps loaded (checkpoint x format), least recently used first out.
MAX_ENGINES: Final = 8


@dataclass(frozen=True)
class WorkerContext:
    """What a worker process keeps between jobs: its settings and its loaded engines (a GPU
    worker must not fork after CUDA initialisation, so it never reloads per job)."""

    settings: Settings
    pool: EnginePool
    #: The GPU kind the worker announced (`queue.route.WorkerKind.kind`: `a10g`, or `cpu`):
    #: its metrics' `gpu_kind` label and each result's `resolved.worker_kind`.
    gpu_kind: str = "cpu"

    @classmethod
    def from_environment(cls) -> WorkerContext:
        """A context from the settings of the environment, with an empty engine pool."""
        settings = Settings()
        pool = EnginePool(
            max_engines=MAX_ENGINES,
            threads=settings.torch_threads,
            # The in-process runner replays beside the API it runs in: it leaves it a core.
            leave_free=1 if settings.runner == "inprocess" else 0,
            on_load=MODEL_LOADS.inc,
        )
        return cls(settings, pool, host_gpu_kind())


#: The worker context of the jobs run in the current context (a thread's, or an in-process
#: runner's copy): set by the worker that runs them, so no context is process-wide.
_bound: ContextVar[WorkerContext | None] = ContextVar("replay_audit_worker_context", default=None)


def install_worker_context(context: WorkerContext | None) -> None:
    """Make `context` the worker context of the jobs run from here on in the current context
    (the calling thread, or the runner whose copy it is); None: build one from the environment
    at the next job. An in-process runner built afterwards inherits it."""
    _bound.set(context)


def worker_context() -> WorkerContext:
    """The worker context bound in the current context, built from the environment on first
    use and kept there (an in-process runner's thread keeps it between its jobs)."""
    context = _bound.get()
    if context is None:
        context = WorkerContext.from_environment()
        _bound.set(context)
    return context
