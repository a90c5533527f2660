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

In the scan modes the job first scans all its traces that still need a result, several per
forward (`Engine.scan_batch`: length buckets packed up to `Settings.scan_token_budget` tokens),
one batch per engine and intervention, then finishes each trace as before (a scan-then-decode
trace the scan flags, or one in the control sample, is decoded), writing it in its own
transaction. A job logs how many traces it did and how fast (traces/s, and the scan's alone).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from replay_audit.config import Settings
from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope
from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import ScanRun
from replay_audit.exceptions import ReplayAuditError
from replay_audit.queue import stop_requested
from replay_audit.replays import repository
from replay_audit.replays.checkpoint import ModelNotFound, find_checkpoint
from replay_audit.replays.domain import (
    Comparison,
    ControlSample,
    LoggedTrace,
    ReplayOutcome,
    RunTarget,
)
from replay_audit.replays.models import ReplayJob, ReplayRun
from replay_audit.replays.replayer import ScanRequest, compare_arms, replay_trace, scan_traces
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
    control: ControlSample | None = None


@dataclass
class _Pending:
    """A trace of the job that still needs results: which comparisons, and its values."""

    trace_id: int
    public_id: str | None
    trace: LoggedTrace | None
    missing: list[int]
    #: Its scans already run (batched), by comparison.
    scans: dict[int, ScanRun] = field(default_factory=dict)


@dataclass
class _JobCounts:
    """What a job did, for its log line."""

    traces: int = 0
    results: int = 0
    scanned: int = 0
    scan_s: float = 0.0
    forwards: int = 0


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
            run.control_sample,
        )
        trace_ids = list(job.trace_ids)

    started = time.perf_counter()
    counts = _JobCounts()
    scanning = spec.mode in ("scan", "scan_then_decode")
    work: Sequence[int | _Pending] = trace_ids
    if scanning:  # every trace's scan first, batched; decode-mode traces load one at a time
        pending = _load_pending(url, spec, trace_ids)
        counts = _scan_all(pending, spec, ctx)
        work = pending
        with session_scope(url) as s:
            repository.touch_job(s, job_id)  # alive: the scan may take a while on a CPU

    for item in work:
        if stop_requested():  # the process is stopping: the rest waits for the next run
            with session_scope(url) as s:
                repository.release_job(s, job_id)
            log.info("replay job %d stopped between traces; it resumes when re-enqueued", job_id)
            return
        if isinstance(item, _Pending):
            p = item
        else:
            loaded = _load_pending(url, spec, [item])
            if not loaded:
                continue
            p = loaded[0]
        rows = (
            _replay_one(p, spec, ctx)
            if p.trace is not None
            else [failed_values(c, "trace was deleted") for c in p.missing]
        )
        with session_scope(url) as s:
            repository.insert_results(s, spec.run_id, p.trace_id, rows)
            repository.touch_job(s, job_id)  # the heartbeat the reconciler reads
        counts.traces += 1
        counts.results += len(rows)

    with session_scope(url) as s:
        repository.finish_job(s, job_id)
        run = s.get(ReplayRun, spec.run_id)
        progress = (sum(repository.progress(s, run)), run.n_items) if run is not None else None
    _log_job(job_id, spec, counts, time.perf_counter() - started, progress)


def _log_job(
    job_id: int,
    spec: _RunSpec,
    counts: _JobCounts,
    seconds: float,
    progress: tuple[int, int] | None,
) -> None:
    """The job's line in the worker's log: traces and results done, traces/s, the batched
    scan's own throughput, and how far the run is."""
    rate = counts.traces / seconds if seconds > 0 else 0.0
    scan = ""
    if counts.scanned:
        scan_rate = counts.scanned / counts.scan_s if counts.scan_s > 0 else 0.0
        scan = (
            f"; scanned {counts.scanned} in {counts.forwards} forward(s), {counts.scan_s:.2f} s "
            f"({scan_rate:.1f} traces/s)"
        )
    done = f"; run at {progress[0]}/{progress[1]} results" if progress is not None else ""
    log.info(
        "replay job %d (run %d, %s): %d traces, %d results in %.2f s (%.1f traces/s)%s%s",
        job_id,
        spec.run_id,
        spec.mode,
        counts.traces,
        counts.results,
        seconds,
        rate,
        scan,
        done,
    )


def _load_pending(url: str, spec: _RunSpec, trace_ids: Sequence[int]) -> list[_Pending]:
    """The traces of `trace_ids` that still need results, with their values (one read)."""
    out = []
    with session_scope(url) as s:
        for trace_id in trace_ids:
            missing = repository.missing_comparisons(
                s, spec.run_id, trace_id, len(spec.comparisons)
            )
            if not missing:
                continue
            row = s.get(Trace, trace_id)
            trace = repository.logged_trace(row) if row is not None else None
            out.append(_Pending(trace_id, row.public_id if row else None, trace, missing))
    return out


def _scan_all(pending: list[_Pending], spec: _RunSpec, ctx: WorkerContext) -> _JobCounts:
    """Scan every pending (trace, comparison against the logged tokens) in batches
    (`replayer.scan_traces`); a pair left unscanned is scanned alone by its replay."""
    pairs: list[tuple[_Pending, int]] = []
    requests: list[ScanRequest] = []
    for p in pending:
        if p.trace is None:
            continue
        try:
            model_dir = find_checkpoint(p.trace.weights_sha256, ctx.settings.model_dirs, ctx.pool)
        except ModelNotFound:
            continue  # the per-trace replay reports it
        for c in p.missing:
            comparison = spec.comparisons[c]
            if comparison.against_logged:
                target = spec.targets[comparison.b].resolve(p.trace.config)
                pairs.append((p, c))
                requests.append(ScanRequest(p.trace, target, model_dir))
    scans = scan_traces(
        requests, ctx.pool, top_k=spec.top_k, token_budget=ctx.settings.scan_token_budget
    )
    for (p, c), run in zip(pairs, scans.runs, strict=True):
        if run is not None:
            p.scans[c] = run
    return _JobCounts(scanned=scans.scanned, scan_s=scans.seconds, forwards=scans.forwards)


def _replay_one(p: _Pending, spec: _RunSpec, ctx: WorkerContext) -> list[dict[str, object]]:
    trace = p.trace
    assert trace is not None
    comparisons = p.missing
    try:
        model_dir = find_checkpoint(trace.weights_sha256, ctx.settings.model_dirs, ctx.pool)
    except ModelNotFound as e:
        return [failed_values(c, str(e)) for c in comparisons]
    control = spec.control is not None and spec.control.includes(p.public_id or str(p.trace_id))
    out = []
    for c in comparisons:
        try:
            outcome = _compare(
                trace,
                spec,
                spec.comparisons[c],
                ctx.pool,
                model_dir,
                scan=p.scans.get(c),
                control=control,
            )
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
    *,
    scan: ScanRun | None = None,
    control: bool = False,
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
            scan=scan,
            control=control,
        )
    target_a = spec.targets[comparison.a].resolve(trace.config)
    return compare_arms(
        trace, target_a, target_b, pool, model_dir=model_dir, top_k=spec.top_k, extractor=extractor
    )
