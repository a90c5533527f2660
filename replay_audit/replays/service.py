"""Replay runs: create (validate the request, resolve the selection, plan the jobs), read.

Services take a session and never commit. Jobs are enqueued with `after_commit`, so a worker
never looks for rows that are not there yet, and a rolled-back request enqueues nothing.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from sqlalchemy.orm import Session

from replay_audit.config import Settings
from replay_audit.db.base import read_model, utcnow
from replay_audit.db.ids import decode_cursor, encode_cursor, new_public_id
from replay_audit.db.jobs import insert_once
from replay_audit.exceptions import FieldError
from replay_audit.formats import EXTRA_PROCESSORS, Mode, processors_not_applied
from replay_audit.json_value import JsonObject
from replay_audit.queue import Capabilities, JobQueue
from replay_audit.queue.route import ANY_KIND, DeviceQueue, Route, gpu_kind, live_kinds
from replay_audit.replays import repository, statistics
from replay_audit.replays.domain import (
    DEFAULT_SCAN_FLAG_ULPS,
    ENGINE_CHECK_LABEL,
    LARGE_RUN_DECODE_WINDOW,
    LARGE_RUN_FLAGGED_FRACTION,
    LARGE_RUN_TRACES,
    Comparison,
    LoggedPlacement,
    ResolvedArm,
    RunTarget,
    resolve_flagged_fraction,
    resolve_mode,
    resolve_window,
)
from replay_audit.replays.models import ReplayJob, ReplayRun
from replay_audit.replays.reconcile import job_spec
from replay_audit.replays.results import failed_values, result_read
from replay_audit.replays.schemas import (
    MAX_REPLAY_TRACES,
    Page,
    Progress,
    RanRead,
    ReplayCreate,
    ReplayRead,
)
from replay_audit.traces import repository as traces_repository
from replay_audit.traces.models import Trace
from replay_audit.traces.selection import is_greedy
from replay_audit.words import counted

#: Traces per job of a decode run: small enough that a killed job loses little, large enough
#: that a GPU worker keeps its model busy between queue round trips.
TRACES_PER_JOB: Final = 16
#: Traces per job by mode. A scan job scans its traces in batched forwards (up to the worker's
#: scan token budget each: 32 traces of 512 tokens at the default 16k), so it takes many more
#: traces for the same time; a scan-then-decode job also decodes the traces its scan flags (and
#: its control sample), so it sits between.
TRACES_PER_JOB_BY_MODE: Final[dict[Mode, int]] = {
    "decode": TRACES_PER_JOB,
    "scan_then_decode": 64,
    "scan": 256,
}
#: Logged batches a scan-then-decode job holds, for traces logged in batches of more than one
#: row (`job_traces`): its decodes from the prompt (the control sample, near-ties) replay
#: their rows in their logged batch, one `generate()` of the whole batch for every row of it
#: that a window decodes, so a job of a few rows of interest pays a whole batch's decode
#: (~40 s for 256 rows of 512 tokens of a 1 B model on an H200) where 8 batches' traces
#: (~1-5% decoded) share one or two.
BATCHES_PER_SCAN_THEN_DECODE_JOB: Final = 8


def job_traces(mode: Mode, batch_size: int, device: DeviceQueue = "gpu") -> int:
    """Traces per job of a run in `mode`, for traces logged in batches of `batch_size` rows
    replayed on `device`. Unbatched: `TRACES_PER_JOB_BY_MODE`. Batched, a decode job holds a
    whole batch (its rows decode in one run, `Engine.decode_batch`: one run's time for them
    all) and, on a GPU, a scan-then-decode job `BATCHES_PER_SCAN_THEN_DECODE_JOB` batches (on
    a CPU eight batches' scans would outlast a job's timeout: its jobs stay small); a scan job
    decodes nothing. `batch_size` is the batch the run decodes these rows in: 1 where no arm
    decodes them in their logged batch (`run_decodes_logged_batches`), so that its jobs are
    the unbatched size and more of them share the workers."""
    size = TRACES_PER_JOB_BY_MODE[mode]
    if batch_size <= 1 or mode == "scan":
        return size
    if mode == "decode":
        return max(size, batch_size)
    if device != "gpu":
        return size
    return max(size, BATCHES_PER_SCAN_THEN_DECODE_JOB * batch_size)


def run_decodes_logged_batches(targets: Sequence[RunTarget], batch_size: int) -> bool:
    """Whether a run of `targets` decodes a row logged in a batch of `batch_size` rows in that
    batch (`LoggedTrace.layout_for`): its reproduction check (a self target replays the logged
    configuration, batch included) or a target of the logged batch's size does."""
    return any(t.target is None or t.target.batch_size == batch_size for t in targets)


def _select_traces(session: Session, project_id: int, request: ReplayCreate) -> list[Trace]:
    """The traces a request names (`trace_ids`, in the order given; every one must exist and be
    greedy) or its `filter` selects (greedy ones only, oldest first)."""
    if request.trace_ids is not None:
        wanted = list(dict.fromkeys(request.trace_ids))
        rows = {t.public_id: t for t in traces_repository.get_traces(session, project_id, wanted)}
        unknown = [i for i in wanted if i not in rows]
        if unknown:
            shown = ", ".join(unknown[:10]) + (" ..." if len(unknown) > 10 else "")
            raise FieldError(f"unknown trace ids: {shown}", field="trace_ids")
        not_greedy = [_not_greedy(rows[i]) for i in wanted if not is_greedy(rows[i].decoding)]
        if not_greedy:
            raise FieldError(
                "only greedy traces can be replayed; not greedy: " + ", ".join(not_greedy[:10]),
                field="trace_ids",
            )
        return [rows[i] for i in wanted]
    assert request.filter is not None
    stmt = traces_repository.select_traces(project_id, request.filter.to_selection())
    return list(
        session.scalars(stmt.order_by(None).order_by(Trace.id).limit(MAX_REPLAY_TRACES + 1))
    )


def _not_greedy(trace: Trace) -> str:
    """A trace's id, with the logits processors that made its greedy request unreplayable (a
    replay applies repetition penalty, no-repeat n-grams, min tokens, logit bias and bad words,
    and no other)."""
    extras = json.loads(trace.config.config_json).get("extras") or {}
    return trace.public_id + processors_not_applied(extras.get(EXTRA_PROCESSORS))


def _comparisons(request: ReplayCreate, n_targets: int) -> list[Comparison]:
    if request.compare == "logged":
        return [Comparison(i, "logged", i) for i in range(n_targets)]
    pairs = request.pairs or [(i, j) for i in range(n_targets) for j in range(i + 1, n_targets)]
    return [Comparison(k, a, b) for k, (a, b) in enumerate(pairs)]


def _with_engine_check(
    request: ReplayCreate, targets: list[RunTarget], comparisons: list[Comparison]
) -> tuple[list[RunTarget], list[Comparison]]:
    """Reproduce before comparing: every run first replays each trace in its own logged
    configuration (a self target, unless it has one, compared with the logged tokens, unless
    it is), so each result says whether the logged tokens reproduce here, and each comparison
    with the logged tokens is judged against the right baseline (`pipeline.replay_traces`).
    `engine_check: off` leaves the run as asked."""
    if request.engine_check == "off":
        return targets, comparisons
    self_index = next((i for i, t in enumerate(targets) if t.is_self), None)
    if self_index is None:
        targets = [*targets, RunTarget(None, label=ENGINE_CHECK_LABEL)]
        self_index = len(targets) - 1
    if not any(c.against_logged and c.b == self_index for c in comparisons):
        comparisons = [*comparisons, Comparison(len(comparisons), "logged", self_index)]
    return targets, comparisons


def _queue(targets: Sequence[RunTarget], default: str) -> DeviceQueue:
    """`cpu` when every target runs on the CPU (`device: cpu`, or neither a device nor a GPU
    kind where the deployment's default queue is `cpu`), else `gpu`: a target naming a GPU
    kind runs on a GPU of that kind."""
    queues = {
        "gpu" if t.device == "cuda" or (t.device is None and t.gpu_kind) else t.device or default
        for t in targets
        if not t.is_self
    }
    return "cpu" if queues == {"cpu"} or (not queues and default == "cpu") else "gpu"


def route_of(placement: LoggedPlacement, targets: Sequence[RunTarget], default: str) -> Route:
    """Which workers may replay a trace logged at `placement` in `targets` (one job runs all of
    a trace's arms, so one worker does): the device queue of the targets (`_queue`); on the
    GPU, the kind a target names (`any`: any GPU), else the trace's logged GPU kind (any GPU
    for a trace logged on a CPU or without its GPU); the largest TP degree of the arms, each
    the target's, else the trace's logged degree (a worker must own that many devices; a
    self arm's degree is the logged one; the reproduction check's counts only where no target
    names a degree)."""
    device = _queue(targets, default)
    kind = None
    if device == "gpu":
        named = next((t.gpu_kind for t in targets if not t.is_self and t.gpu_kind), None)
        if named is not None:
            kind = None if named == ANY_KIND else named
        elif placement.gpu_name is not None:
            with contextlib.suppress(ValueError):  # a logged name that names no kind: any GPU
                kind = gpu_kind(placement.gpu_name)
    logged_tp = placement.tp_degree or 1
    degree_named = any(t.tp_degree is not None for t in targets)
    # A self arm runs the logged degree; the reproduction check a run adds does not hold the
    # run back where a target names another degree: it runs there, or fails saying why.
    tp = max(
        (t.tp_degree or logged_tp) if not t.is_self else logged_tp
        for t in targets
        if not (degree_named and t.is_self and t.label == ENGINE_CHECK_LABEL)
    )
    return Route(device, kind, tp)


def _recorded(
    request: ReplayCreate,
    mode: str,
    scan_flag_ulps: float,
    decode_window: int | None,
    flagged_fraction: float,
) -> JsonObject:
    """The request as the run stores it, with the near-tie flag a scan-then-decode run uses
    (the deployment's where the request names none), so every worker applies the same one,
    and the decode window and flagged fraction that run (`resolve_window`,
    `resolve_flagged_fraction`), so the stored request and the run say the same."""
    stored: JsonObject = request.model_dump(mode="json")
    if mode == "scan_then_decode" and stored.get("scan_flag_ulps") is None:
        stored["scan_flag_ulps"] = scan_flag_ulps
    stored["decode_window"] = decode_window
    stored["flagged_fraction"] = flagged_fraction
    return stored


@dataclass(frozen=True)
class RunDefaults:
    """How this deployment plans a run whose request leaves it open, read where runs are
    created (requests, audits, the CLI) from the settings."""

    #: Runs of at least this many traces that name no mode are replayed scan-then-decode
    #: (`Settings.large_run_traces`).
    large_run_traces: int = LARGE_RUN_TRACES
    #: The near-tie flag of scan-then-decode runs that name none (`Settings.scan_flag_ulps`).
    scan_flag_ulps: float = DEFAULT_SCAN_FLAG_ULPS
    #: The decode window of a large run that names neither mode nor window
    #: (`Settings.large_run_decode_window`).
    large_run_decode_window: int = LARGE_RUN_DECODE_WINDOW
    #: The flagged fraction of a large run that names neither mode nor fraction
    #: (`Settings.large_run_flagged_fraction`).
    large_run_flagged_fraction: float = LARGE_RUN_FLAGGED_FRACTION

    @classmethod
    def from_settings(cls, settings: Settings) -> RunDefaults:
        return cls(
            settings.large_run_traces,
            settings.scan_flag_ulps,
            settings.large_run_decode_window,
            settings.large_run_flagged_fraction,
        )


def create_replay(
    session: Session,
    project_id: int,
    request: ReplayCreate,
    queue: JobQueue,
    *,
    defaults: RunDefaults,
    schedule_id: str | None = None,
) -> tuple[ReplayRun, bool]:
    """Validate and store a replay run and its jobs; enqueue the jobs after commit.

    Returns (run, created). With an `idempotency_key` already used in this project, the existing
    run comes back and nothing is stored or enqueued. A request naming no `mode` is replayed
    scan-then-decode when it selects `defaults.large_run_traces` traces or more (a large run),
    decode otherwise; a large run that names no `decode_window` either decodes to t* +
    `defaults.large_run_decode_window`, and one that names no `flagged_fraction` decodes
    that share (`defaults.large_run_flagged_fraction`) of the traces its scan flags.
    """
    key = request.idempotency_key
    existing = key and repository.get_run_by_idempotency_key(session, project_id, key)
    if existing:
        return existing, False

    targets = [t.to_domain() for t in request.targets]
    targets += [RunTarget(None)] if request.compare_with == "self" else []
    check_targets(queue.capabilities, targets, field="targets")
    queue.check()  # a 503 before anything is stored when the queue is down

    traces = _select_traces(session, project_id, request)
    if not traces:
        raise FieldError("the selection matches no (greedy) trace", field="filter")
    if len(traces) > MAX_REPLAY_TRACES:
        raise FieldError(
            f"the selection matches more than {MAX_REPLAY_TRACES} traces; narrow it",
            field="filter" if request.filter is not None else "trace_ids",
        )

    ids = [t.id for t in traces]
    targets, comparisons = _with_engine_check(request, targets, _comparisons(request, len(targets)))
    mode = resolve_mode(request.mode, len(traces), defaults.large_run_traces)
    window = resolve_window(
        request.mode,
        request.decode_window,
        mode,
        pairwise=request.compare == "pairwise",
        large_run_window=defaults.large_run_decode_window,
    )
    flagged_fraction = resolve_flagged_fraction(
        request.mode,
        request.flagged_fraction,
        mode,
        pairwise=request.compare == "pairwise",
        large_run_fraction=defaults.large_run_flagged_fraction,
    )
    chunks = _chunks(
        repository.logged_placements(session, ids), ids, targets, queue.default_queue, mode
    )
    run, created = insert_once(
        session,
        ReplayRun(
            public_id=new_public_id("rr"),
            project_id=project_id,
            name=request.name,
            status="queued",
            mode=mode,
            decode_window=window,
            compare=request.compare,
            request=_recorded(request, mode, defaults.scan_flag_ulps, window, flagged_fraction),
            targets=[t.to_json() for t in targets],
            comparisons=[c.to_json() for c in comparisons],
            n_traces=len(traces),
            n_items=len(traces) * len(comparisons),
            idempotency_key=request.idempotency_key,
            schedule_id=schedule_id,
        ),
        "run",
    )
    if created:
        jobs = zip(repository.add_jobs(session, run, chunks), chunks, strict=True)
        queue.enqueue(session, [job_spec(i, name, queue.job_timeout_s) for i, (name, _) in jobs])
    return run, created


def _chunks(
    placements: Mapping[int, LoggedPlacement],
    ids: Sequence[int],
    targets: Sequence[RunTarget],
    default: str,
    mode: Mode,
) -> list[tuple[str, list[int]]]:
    """The run's jobs: its traces grouped by route (`route_of`) and job size (`job_traces` of
    their logged batch), in order of first appearance, each group cut in chunks of its size;
    (queue name, trace ids) each."""
    groups: dict[tuple[str, int], list[int]] = {}
    for trace_id in ids:
        placement = placements.get(trace_id, LoggedPlacement())
        route = route_of(placement, targets, default)
        batch = placement.batch_size
        decoded = batch if run_decodes_logged_batches(targets, batch) else 1
        size = job_traces(mode, decoded, route.device)
        groups.setdefault((route.queue, size), []).append(trace_id)
    return [
        (name, members[i : i + size])
        for (name, size), members in groups.items()
        for i in range(0, len(members), size)
    ]


#: lm_head formats only a CUDA GPU can compute.
FP8_HEAD_DTYPES: Final = frozenset({"fp8_e4m3", "fp8_e5m2"})


def target_refusal(
    capabilities: Capabilities, *, lm_head_dtype: str | None, device: str | None
) -> str | None:
    """Why a target with this lm_head format and device cannot run where this deployment runs
    its jobs (None: it can).

    `rq`: GPU and CPU workers take the jobs, so every target is accepted here; a worker that
    cannot run one (an fp8 lm_head on a GPU below SM 8.9) fails that item saying why.
    `inprocess`: the jobs run in this process, on its CUDA device when the host has one, else
    on the CPU."""
    if capabilities.runner != "inprocess" or capabilities.cuda:
        return None
    if device == "cuda":
        return (
            "this embedded deployment has no CUDA device; run a GPU worker "
            "(REPLAY_AUDIT_RUNNER=rq and `replay-audit worker --queue gpu`)"
        )
    if lm_head_dtype in FP8_HEAD_DTYPES:
        return (
            f"an {lm_head_dtype} lm_head needs a CUDA GPU of compute capability >= 8.9, and "
            "this embedded deployment has none (REPLAY_AUDIT_RUNNER=rq with a GPU worker)"
        )
    return None


def check_targets(capabilities: Capabilities, targets: Sequence[RunTarget], *, field: str) -> None:
    """A 422 naming the first target this deployment cannot run, saying why."""
    for i, t in enumerate(targets):
        why = target_refusal(
            capabilities,
            lm_head_dtype=t.target.lm_head_dtype if t.target is not None else None,
            device=t.device,
        )
        if why is not None:
            raise FieldError(f"{field}[{i}]: {why}", field=f"{field}[{i}]")


# --- a job's end: the worker's side (`replays.tasks`) ----------------------------------------


def finish_job(session: Session, job_id: int) -> None:
    """Mark the job done; if no job of its run is left unfinished, finalise the run.

    The run row is locked first (`repository.lock_run`), so of two jobs finishing at once
    exactly one sees the other's commit and finalises."""
    job = session.get(ReplayJob, job_id)
    if job is None:
        return
    run = repository.lock_run(session, job.run_id)
    job.status, job.updated_at, job.error = "done", utcnow(), None
    session.flush()
    if repository.count_unfinished_jobs(session, run.id) == 0:
        finalise_run(session, run)


def fail_job(session: Session, job_id: int, reason: str) -> None:
    """A job that will not be retried: its traces get failed results saying why."""
    job = session.get(ReplayJob, job_id)
    if job is None or job.status == "done":
        return
    run = repository.lock_run(session, job.run_id)
    todo = repository.missing_comparisons_of(session, run.id, job.trace_ids, len(run.comparisons))
    failed = [(t, [failed_values(c, reason) for c in missing]) for t, missing in todo.items()]
    repository.insert_results_of(session, run.id, failed)
    job.error = reason
    session.flush()
    finish_job(session, job_id)


def finalise_run(session: Session, run: ReplayRun) -> None:
    """Store the run's statistics and its final status (done, or failed when every item
    failed)."""
    stats = statistics.compute(session, run)
    run.aggregate = stats.model_dump(mode="json")
    run.finished_at = utcnow()
    if sum(c.n for c in stats.comparisons) and not any(c.ok for c in stats.comparisons):
        run.status = "failed"
        run.error = f"every item failed; first reason: {repository.first_failure(session, run.id)}"
    else:
        run.status = "done"


# --- reading -----------------------------------------------------------------------------------


def get_replay(session: Session, project_id: int, public_id: str) -> ReplayRun:
    return repository.get_run(session, project_id, public_id, f"no replay run {public_id!r}")


def pending_reason(session: Session, run: ReplayRun, queue: JobQueue | None) -> str | None:
    """Why some of the run's jobs wait with no worker to take them: the route of each queue
    that no live worker serves (a GPU kind without a live worker, a TP degree no live worker
    owns the devices for), the live workers, and what the request could change. None when
    every unfinished job has a worker that serves it, when the run is finished, or when the
    queue cannot say (`JobQueue.live_workers`)."""
    if queue is None or run.status in ("done", "failed"):
        return None
    waiting = repository.unfinished_queues(session, run.id)
    answer = queue.unserved(waiting) if waiting else None
    if not answer or not answer[0]:
        return None
    unserved, workers = answer
    needs = []
    for name in unserved:
        route = Route.parse(name)
        who = route.describe() if route is not None else f"a worker of queue {name!r}"
        n = waiting[name]
        needs.append(f"{counted(n, 'job')} need{'s' if n == 1 else ''} {who} (queue {name})")
    hints = []
    routes = [r for r in map(Route.parse, unserved) if r is not None]
    if any(r.kind is not None for r in routes):
        hints.append('a target\'s gpu_kind: "any" takes any GPU kind')
    if any(r.tp_degree > 1 for r in routes):
        hints.append("a target's tp_degree: 1 replays at TP 1 (the result says so)")
    return (
        "waiting for a worker: "
        + "; ".join(needs)
        + f"; no live worker serves them (live: {live_kinds(workers)})"
        + (". Start one, or ask otherwise: " + "; ".join(hints) if hints else ". Start one")
    )


def to_read(
    session: Session,
    run: ReplayRun,
    project: str,
    *,
    status_only: bool = False,
    queue: JobQueue | None = None,
) -> ReplayRead:
    """Status, progress and the run's statistics (stored, or computed over the results so far
    while it runs), and why jobs wait where no live worker serves them (`pending_reason`:
    `queue` None, not asked).

    `status_only` (a submitter's view): no `statistics` (its lifts list the traces each
    treatment fixed and broke) and `request` without its `trace_ids`; what is left says how
    far the run is, not what it found."""
    ok, failed = repository.progress(session, run)
    stats = statistics.of_run(session, run) if ok + failed and not status_only else None
    request = run.request
    if status_only:
        request = {k: v for k, v in request.items() if k != "trace_ids"}
    return read_model(
        ReplayRead,
        run,
        id=run.public_id,
        project=project,
        request=request,
        progress=Progress(
            total=run.n_items, done=ok, failed=failed, pending=run.n_items - ok - failed
        ),
        results_per_s=results_per_s(run, ok + failed),
        ran=[] if status_only else ran(session, run),
        statistics=stats,
        pending_reason=pending_reason(session, run, queue),
    )


def ran(session: Session, run: ReplayRun) -> list[RanRead]:
    """What ran in `run`, per comparison (`repository.resolved_arms`), with labels."""

    none = "not recorded"

    def label(arm: str | None, none: str) -> str:
        return ResolvedArm.from_json(json.loads(arm)).label() if arm is not None else none

    return [
        RanRead(
            comparison=c,
            a=json.loads(a) if a is not None else None,
            b=json.loads(b) if b is not None else None,
            label_a=label(a, "logged tokens" if run.run_comparisons[c].against_logged else none),
            label_b=label(b, none),
            results=n,
        )
        for c, a, b, n in repository.resolved_arms(session, run.id)
    ]


def results_per_s(run: ReplayRun, results: int) -> float | None:
    """A run's throughput: `results` (its results written so far) per second since it started,
    until it finished or now; None before it started or wrote anything."""
    if run.started_at is None or not results:
        return None
    elapsed = ((run.finished_at or utcnow()) - run.started_at).total_seconds()
    return results / elapsed if elapsed > 0 else None


def results_page(session: Session, run: ReplayRun, *, cursor: str | None, limit: int) -> Page:
    after = decode_cursor("r", cursor) if cursor else None
    rows = repository.results_page(session, run, after=after, limit=limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    trace_ids = [r.trace_id for r, _ in rows]
    reproduced = statistics.engine_reproduced(session, run, trace_ids)
    sources = repository.token_ids_sources(session, trace_ids)
    return Page(
        items=[
            result_read(
                r,
                pid,
                run.public_id,
                engine_reproduced=reproduced.get(r.trace_id),
                token_ids_source=sources[r.trace_id],
            )
            for r, pid in rows
        ],
        next_cursor=encode_cursor("r", rows[-1][0].id) if more and rows else None,
    )
