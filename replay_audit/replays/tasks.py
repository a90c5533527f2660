"""The replay job: what a runner executes for one `replay_jobs` row.

Contract (DESIGN.md): the job takes an id, reloads its rows, is idempotent, and writes each
trace's results in one transaction (a decode job one trace per transaction; a scan job a window
of traces per transaction, `RERUN_WINDOW`). It may be killed at any point and run again (and
returns between two traces, or windows, when its runner is stopping): results already written
are skipped (and `INSERT ... ON CONFLICT DO NOTHING` on the unique (run, trace, comparison) key
makes a race between two copies harmless); the run is finalised by whichever job finishes last,
under a row lock on the run.

A worker has one `worker.context.WorkerContext` (its settings and its engines, each checkpoint
loaded once per format and kept loaded), owned by the worker, never by this module.

In the scan modes the job first scans all its traces that still need a result, batched
(`pipeline.scan_items`), then finishes them a window at a time (`pipeline.replay_traces`); a
scan-then-decode window of a logged batch writes the traces its scans settled
(`pipeline.settled_traces`) before it decodes the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from replay_audit.db.base import utcnow
from replay_audit.db.job_row import (
    give_up_message,
    held_elsewhere,
    leased,
    outlasting_outages,
    recording_errors,
    take_lease,
)
from replay_audit.db.unit_of_work import session_scope
from replay_audit.engine.protocol import ScanRun
from replay_audit.exceptions import ReplayAuditError
from replay_audit.json_value import as_int
from replay_audit.queue import stop_requested
from replay_audit.replays import repository, service
from replay_audit.replays.domain import (
    SCAN_FLAG_OFF,
    Comparison,
    ControlSample,
    LoggedTrace,
    ReplayOutcome,
    RunTarget,
)
from replay_audit.replays.models import ReplayJob, ReplayRun
from replay_audit.replays.pipeline import (
    ReplayItem,
    ReplayOptions,
    ReplayResult,
    replay_traces,
    scan_items,
    settled_traces,
)
from replay_audit.replays.results import ResultRow, failed_values, result_values
from replay_audit.telemetry.log import bound
from replay_audit.telemetry.metric import REPLAY_TOKENS, REPLAY_TRACES
from replay_audit.words import counted
from replay_audit.worker.checkpoint import ModelNotFound, find_checkpoint
from replay_audit.worker.context import WorkerContext, worker_context

log = logging.getLogger(__name__)

#: A job started this many times without finishing is failed for good: its remaining traces get
#: failed results saying so, and the run completes instead of looping forever.
MAX_JOB_ATTEMPTS = 5
#: Traces of a scan job replayed together, their single-step re-runs at t* batched, before
#: their results are written (one transaction each): a scan job's whole chunk; a
#: scan-then-decode window is smaller, because its flagged traces are decoded first and a
#: window's results wait for its slowest decode (but a logged batch's traces share one window,
#: their decodes one run of the batch: `_windows`).
RERUN_WINDOW: dict[str, int] = {"scan": 256, "scan_then_decode": 16}


@dataclass(frozen=True)
class _RunSpec:
    run_id: int
    options: ReplayOptions
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
    #: Its items to replay, one per missing comparison (None: it failed before, with this row).
    items: list[ReplayItem | ResultRow] = field(default_factory=list)
    #: Its scans already run (batched), one per item.
    scans: list[ScanRun | None] = field(default_factory=list)


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
        # Locked (PostgreSQL; SQLite's write transactions are serialised): of two starts at
        # once, the second reads the first's lease. A start while another holds the job
        # (Redis restarted and the reconciler enqueued it again, or RQ delivered it twice)
        # backs off, claiming no attempt.
        job = s.get(ReplayJob, job_id, with_for_update=True)
        if job is None or job.status == "done" or held_elsewhere(job):
            return
        if job.attempts >= MAX_JOB_ATTEMPTS:
            service.fail_job(s, job_id, give_up_message(job.attempts, job.error))
            return
        run = s.get(ReplayRun, job.run_id)
        assert run is not None  # FK
        now = utcnow()
        job.status, job.attempts, job.updated_at = "running", job.attempts + 1, now
        take_lease(job)
        if run.status == "queued":
            run.status, run.started_at = "running", now
        control = run.control_sample
        options = ReplayOptions(
            mode=run.mode,  # type: ignore[arg-type]  # a stored run's mode is one of MODES
            top_k=as_int(run.request.get("top_k", 5)),
            flag_ulps=control.flag_ulps if control is not None else SCAN_FLAG_OFF,
            token_budget=ctx.settings.scan_token_budget,
            worker_kind=ctx.gpu_kind,
            decode_window=run.decode_window,
            check_weights=False,  # each trace's checkpoint was found by its weights_sha256
            # A run recorded before the option probed from scratch.
            single_step=run.request.get("single_step") or "from_scratch",  # type: ignore[arg-type]
        )
        spec = _RunSpec(run.id, options, run.run_targets, run.run_comparisons, control)
        trace_ids = list(job.trace_ids)

    with bound(run_id=spec.run_id), leased(url, ReplayJob, job_id):
        # Resumable (a retry replays only the items without a result): a database or Redis
        # outage is waited out in this attempt. What fails it is kept for the give-up to name.
        body = lambda: _run_job(job_id, spec, trace_ids, url, ctx)  # noqa: E731
        with recording_errors(url, ReplayJob, job_id):
            outlasting_outages(body, f"replay job {job_id}")


def _run_job(
    job_id: int, spec: _RunSpec, trace_ids: list[int], url: str, ctx: WorkerContext
) -> None:
    started = time.perf_counter()
    counts = _JobCounts()
    scanning = spec.options.mode in ("scan", "scan_then_decode")
    work = _load_pending(url, spec, trace_ids, ctx)
    if scanning:  # every trace's scan first, batched, then windows of its traces
        counts = _scan_all(work, spec, ctx)
        with session_scope(url) as s:
            repository.touch_job(s, job_id)  # alive: the scan may take a while on a CPU
        window = RERUN_WINDOW[spec.options.mode]
        if spec.options.mode == "scan_then_decode":  # its decodes share logged batches' runs
            chunks = _windows(work, window)
        else:
            chunks = [work[start : start + window] for start in range(0, len(work), window)]
    else:
        chunks = _windows(work, 1)
    finished = False
    for n, chunk in enumerate(chunks):
        if stop_requested():  # the process is stopping: the rest waits for the next run
            with session_scope(url) as s:
                repository.release_job(s, job_id)
            log.info("replay job %d stopped between traces; it resumes when re-enqueued", job_id)
            return
        parts = []
        if spec.options.mode == "scan_then_decode" and len(chunk) > RERUN_WINDOW[spec.options.mode]:
            # A logged batch's window: the traces its scans settled first, then its decodes.
            settled, chunk = _replay(chunk, spec, ctx, decode=False)
            parts += [settled] if settled else []
        if chunk:
            parts.append(_replay(chunk, spec, ctx)[0])
        for k, done in enumerate(parts):
            # A window's results in one transaction (each trace's rows whole, none twice: the
            # unique key), with the heartbeat the reconciler reads; the last one's with the
            # job's end, so a run never reads `running` with all its results stored.
            with session_scope(url) as s:
                repository.insert_results_of(s, spec.run_id, [(p.trace_id, r) for p, r in done])
                repository.touch_job(s, job_id)
                if n == len(chunks) - 1 and k == len(parts) - 1:
                    service.finish_job(s, job_id)
                    finished = True
            counts.traces += len(done)
            counts.results += sum(len(r) for _, r in done)

    with session_scope(url) as s:
        if not finished:
            service.finish_job(s, job_id)
        run = s.get(ReplayRun, spec.run_id)
        progress = (sum(repository.progress(s, run)), run.n_items) if run is not None else None
    _log_job(job_id, spec, counts, time.perf_counter() - started, progress)


def _windows(pending: Sequence[_Pending], rest: int) -> list[list[_Pending]]:
    """A job's windows where it decodes: the traces logged in batches of one layout together
    (their decodes share runs of that batch: `Engine.decode_batch`, about one trace's time for
    them all), every other trace in windows of `rest` (1 in a decode job: its results saved as
    soon as it is done), in the job's order."""
    batches: dict[tuple[int, ...], list[_Pending]] = {}
    windows: list[list[_Pending]] = []
    lone: list[_Pending] = []  # the open window of traces of no logged batch
    for p in pending:
        layout = p.trace.batch_layout if p.trace is not None else None
        if layout is not None and layout.size > 1:
            if layout.prompt_lengths not in batches:
                batches[layout.prompt_lengths] = []
                windows.append(batches[layout.prompt_lengths])
                lone = []  # the job's order: later lone traces open a new window
            batches[layout.prompt_lengths].append(p)
            continue
        if not lone or len(lone) >= rest:
            lone = []
            windows.append(lone)
        lone.append(p)
    return windows


def _log_job(
    job_id: int,
    spec: _RunSpec,
    counts: _JobCounts,
    seconds: float,
    progress: tuple[int, int] | None,
) -> None:
    """The job's line in the worker's log."""
    rate = counts.traces / seconds if seconds > 0 else 0.0
    scan = ""
    if counts.scanned:
        scan_rate = counts.scanned / counts.scan_s if counts.scan_s > 0 else 0.0
        scan = (
            f"; scanned {counts.scanned} in {counted(counts.forwards, 'forward')}, "
            f"{counts.scan_s:.2f} s ({scan_rate:.1f} traces/s)"
        )
    done = f"; run at {progress[0]}/{progress[1]} results" if progress is not None else ""
    log.info(
        "replay job %d (run %d, %s): %d traces, %d results in %.2f s (%.1f traces/s)%s%s",
        job_id,
        spec.run_id,
        spec.options.mode,
        counts.traces,
        counts.results,
        seconds,
        rate,
        scan,
        done,
    )


def _load_pending(
    url: str, spec: _RunSpec, trace_ids: Sequence[int], ctx: WorkerContext
) -> list[_Pending]:
    """The traces of `trace_ids` that still need results, with their values (one read) and an
    item per missing comparison (or, where the trace or its checkpoint is gone, its failed row)."""
    out = []
    checkpoints: dict[str, Path | ModelNotFound] = {}  # by weights_sha256: one lookup a job
    with session_scope(url) as s:
        todo = repository.missing_comparisons_of(s, spec.run_id, trace_ids, len(spec.comparisons))
        rows = repository.traces_by_id(s, [t for t in trace_ids if todo[t]])
        for trace_id in trace_ids:
            missing = todo[trace_id]
            if not missing:
                continue
            row = rows.get(trace_id)
            trace = repository.logged_trace(row) if row is not None else None
            p = _Pending(trace_id, row.public_id if row else None, trace, missing)
            p.items = _items(p, spec, ctx, checkpoints)
            out.append(p)
    return out


def _items(
    p: _Pending, spec: _RunSpec, ctx: WorkerContext, checkpoints: dict[str, Path | ModelNotFound]
) -> list[ReplayItem | ResultRow]:
    """A pending trace's item per missing comparison, or its failed row (`checkpoints`: the
    job's lookups so far)."""
    trace = p.trace
    if trace is None:
        return [failed_values(c, "trace was deleted") for c in p.missing]
    sha = trace.weights_sha256
    if sha not in checkpoints:
        try:
            checkpoints[sha] = find_checkpoint(sha, ctx.settings.model_dirs)
        except ModelNotFound as e:
            checkpoints[sha] = e
    model_dir = checkpoints[sha]
    if isinstance(model_dir, ModelNotFound):
        return [failed_values(c, str(model_dir)) for c in p.missing]
    key = p.public_id or str(p.trace_id)
    control = spec.control is not None and spec.control.includes(key)
    # Decided per trace as the control sample is: a retried job decides alike.
    decode_flagged = spec.control is None or spec.control.decodes_flagged(key)
    # The answer extractor of a trace's semantic agreement: GSM8K's where it has a reference.
    extractor = "gsm8k" if trace.reference_answer is not None else None
    items: list[ReplayItem | ResultRow] = []
    for c in p.missing:
        comparison = spec.comparisons[c]
        a = None if comparison.against_logged else spec.targets[int(comparison.a)]
        b = spec.targets[comparison.b]
        items.append(
            ReplayItem(trace, b, model_dir, a, control, extractor, decode_flagged=decode_flagged)
        )
    return items


def _scan_all(pending: Sequence[_Pending], spec: _RunSpec, ctx: WorkerContext) -> _JobCounts:
    """Every pending item's batched scan (`pipeline.scan_items`); one left out scans alone."""
    flat = [(p, i) for p in pending for i in p.items if isinstance(i, ReplayItem)]
    scans = scan_items([i for _, i in flat], ctx.pool, spec.options)
    runs = iter(scans.runs)
    for p in pending:
        p.scans = [next(runs) if isinstance(i, ReplayItem) else None for i in p.items]
    tokens = sum(
        len(item.trace.output_token_ids)
        for (_, item), run in zip(flat, scans.runs, strict=True)
        if run is not None
    )
    REPLAY_TRACES.labels("scanned", ctx.gpu_kind).inc(scans.scanned)
    REPLAY_TOKENS.labels("scanned", ctx.gpu_kind).inc(tokens)
    return _JobCounts(scanned=scans.scanned, scan_s=scans.seconds, forwards=scans.forwards)


def _replay(
    pending: Sequence[_Pending], spec: _RunSpec, ctx: WorkerContext, *, decode: bool = True
) -> tuple[list[tuple[_Pending, list[ResultRow]]], list[_Pending]]:
    """The result rows of a window of traces replayed together (`pipeline.replay_traces`), a
    failure as its item's failed row; without `decode`, of the traces no decode is needed for
    (`pipeline.settled_traces`), and the others, left to replay."""
    flat = [(p, n, i) for p in pending for n, i in enumerate(p.items) if isinstance(i, ReplayItem)]
    scans = [p.scans[n] if p.scans else None for p, n, _ in flat]
    items = [i for _, _, i in flat]
    ran: Sequence[ReplayResult | None] = (
        replay_traces(items, ctx.pool, spec.options, scans=scans)
        if decode
        else settled_traces(items, ctx.pool, spec.options, scans=scans)
    )
    results = iter(ran)
    out, rest = [], []
    for p in pending:
        got = [next(results) if isinstance(item, ReplayItem) else item for item in p.items]
        if any(r is None for r in got):
            rest.append(p)
            continue
        rows: list[ResultRow] = []
        for c, result in zip(p.missing, got, strict=True):
            if isinstance(result, Exception):
                rows.append(_failed_row(c, result, p.trace_id))
            elif isinstance(result, ReplayOutcome):
                _count_decode(result, ctx.gpu_kind)
                rows.append(result_values(c, result))
            elif result is not None:
                rows.append(result)
        out.append((p, rows))
    return out, rest


#: The screens of scan-then-decode results no decode produced (the scan settled them).
_NOT_DECODED: Final = frozenset({"scanned", "flagged_scanned", "near_tie_scanned"})


def _count_decode(outcome: ReplayOutcome, gpu_kind: str) -> None:
    """A decoded item in the metrics, with the tokens its arms decoded here (an item a scan
    settled was counted by `_scan_all`)."""
    if outcome.mode == "scan" or outcome.screen in _NOT_DECODED:
        return
    REPLAY_TRACES.labels("decoded", gpu_kind).inc()
    REPLAY_TOKENS.labels("decoded", gpu_kind).inc(
        sum(arm.steps or 0 for arm in (outcome.a, outcome.b) if arm.resolved is not None)
    )


def _failed_row(c: int, error: Exception, trace_id: int) -> ResultRow:
    """Comparison c's failed row: a `ReplayAuditError`'s message, or an engine failure's type
    and text (logged)."""
    if isinstance(error, ReplayAuditError):
        return failed_values(c, error.message)
    log.error("replay of trace %s comparison %d failed", trace_id, c, exc_info=error)
    return failed_values(c, f"{type(error).__name__}: {error}")
