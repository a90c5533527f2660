"""The replay job: what a runner executes for one `replay_jobs` row.

Contract (DESIGN.md): the job takes an id, reloads its rows, is idempotent, and writes each
trace's results in one transaction. It may be killed at any point and run again (and returns
between two traces when its runner is stopping): results already written are skipped (and
`INSERT ... ON CONFLICT DO NOTHING` on the unique (run, trace, comparison) key makes a race
between two copies harmless); the run is finalised by whichever job finishes last, under a row
lock on the run.

A worker process has one `WorkerContext` (its settings and its engines, each checkpoint loaded
once per format and kept loaded): `replay-audit worker` and the tests install it; elsewhere (the
in-process runner of `serve` and the demo) the first job builds it from the environment.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from replay_audit.config import Settings
from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope
from replay_audit.engine.pool import EnginePool
from replay_audit.exceptions import ReplayAuditError
from replay_audit.queue import stop_requested
from replay_audit.replays import repository
from replay_audit.replays.checkpoint import ModelNotFound, find_checkpoint
from replay_audit.replays.domain import Comparison, LoggedTrace, ReplayOutcome, RunTarget
from replay_audit.replays.models import ReplayJob, ReplayRun
from replay_audit.replays.replayer import compare_arms, replay_trace
from replay_audit.replays.results import failed_values, result_values
from replay_audit.traces.models import Trace

log = logging.getLogger(__name__)

#: A job started this many times without finishing is failed for good: its remaining traces get
#: failed results saying so, and the run completes instead of looping forever.
MAX_JOB_ATTEMPTS = 5
#: Engines a worker keeps loaded (checkpoint x format), least recently used first out.
MAX_ENGINES = 8


@dataclass(frozen=True)
class WorkerContext:
    """What a worker process keeps between jobs: its settings and its loaded engines (a GPU
    worker must not fork after CUDA initialisation, so it never reloads per job)."""

    settings: Settings
    pool: EnginePool


_context: WorkerContext | None = None
_context_lock = threading.Lock()


def install_worker_context(context: WorkerContext | None) -> None:
    """Make `context` this process's worker context (None: build one from the environment at
    the next job)."""
    global _context
    with _context_lock:
        _context = context


def worker_context() -> WorkerContext:
    """This process's worker context, built from the environment on first use."""
    global _context
    with _context_lock:
        if _context is None:
            settings = Settings()
            # The in-process runner replays beside the API it runs in: it leaves it a core.
            beside_api = settings.runner == "inprocess"
            pool = EnginePool(
                max_engines=MAX_ENGINES,
                threads=settings.torch_threads,
                leave_free=1 if beside_api else 0,
            )
            _context = WorkerContext(settings, pool)
        return _context


@dataclass(frozen=True)
class _RunSpec:
    run_id: int
    mode: str
    top_k: int
    targets: tuple[RunTarget, ...]
    comparisons: tuple[Comparison, ...]


def run_replay_job(job_id: int, database_url: str | None = None) -> None:
    """Replay every (trace, comparison) of job `job_id` that has no result yet, then finalise the
    run if this was its last unfinished job."""
    ctx = worker_context()
    url = database_url or ctx.settings.database_url
    with session_scope(url) as s:
        job = s.get(ReplayJob, job_id)
        if job is None or job.status == "done":
            return
        if job.attempts >= MAX_JOB_ATTEMPTS:
            repository.fail_job(
                s, job_id, f"gave up after {job.attempts} attempts (worker killed or crashing)"
            )
            return
        run = s.get(ReplayRun, job.run_id)
        assert run is not None  # FK
        now = utcnow()
        job.status, job.attempts, job.updated_at = "running", job.attempts + 1, now
        if run.status == "queued":
            run.status, run.started_at = "running", now
        spec = _RunSpec(
            run.id,
            run.mode,
            int(run.request.get("top_k", 5)),
            run.run_targets,
            run.run_comparisons,
        )
        trace_ids = list(job.trace_ids)

    for trace_id in trace_ids:
        if stop_requested():  # the process is stopping: the rest waits for the next run
            with session_scope(url) as s:
                repository.release_job(s, job_id)
            log.info("replay job %d stopped between traces; it resumes when re-enqueued", job_id)
            return
        with session_scope(url) as s:
            missing = repository.missing_comparisons(
                s, spec.run_id, trace_id, len(spec.comparisons)
            )
            trace_row = s.get(Trace, trace_id) if missing else None
            trace = repository.logged_trace(trace_row) if trace_row is not None else None
        if not missing:
            continue
        rows = (
            _replay_one(trace, spec, missing, ctx)
            if trace is not None
            else [failed_values(c, "trace was deleted") for c in missing]
        )
        with session_scope(url) as s:
            repository.insert_results(s, spec.run_id, trace_id, rows)
            repository.touch_job(s, job_id)  # the heartbeat the reconciler reads

    with session_scope(url) as s:
        repository.finish_job(s, job_id)


def _replay_one(
    trace: LoggedTrace, spec: _RunSpec, comparisons: list[int], ctx: WorkerContext
) -> list[dict[str, object]]:
    try:
        model_dir = find_checkpoint(trace.weights_sha256, ctx.settings.model_dirs, ctx.pool)
    except ModelNotFound as e:
        return [failed_values(c, str(e)) for c in comparisons]
    out = []
    for c in comparisons:
        try:
            outcome = _compare(trace, spec, spec.comparisons[c], ctx.pool, model_dir)
        except ReplayAuditError as e:
            out.append(failed_values(c, e.message))
            continue
        except (RuntimeError, ValueError, MemoryError) as e:  # engine-side failure of this item
            log.exception("replay of trace %s comparison %d failed", trace.external_id, c)
            out.append(failed_values(c, f"{type(e).__name__}: {e}"))
            continue
        out.append(result_values(c, outcome))
    return out


def _compare(
    trace: LoggedTrace,
    spec: _RunSpec,
    comparison: Comparison,
    pool: EnginePool,
    model_dir: Path,
) -> ReplayOutcome:
    target_b = spec.targets[comparison.b].resolve(trace.config)
    extractor = "gsm8k" if trace.reference_answer is not None else None
    if comparison.a == "logged":
        return replay_trace(
            trace,
            target_b,
            pool,
            model_dir=model_dir,
            mode=spec.mode,  # type: ignore[arg-type]
            top_k=spec.top_k,
            extractor=extractor,
        )
    target_a = spec.targets[comparison.a].resolve(trace.config)
    return compare_arms(
        trace, target_a, target_b, pool, model_dir=model_dir, top_k=spec.top_k, extractor=extractor
    )
