"""Audit schedules: create, read, pause, delete; start a run for a due time (its replay run, and
its verification when the schedule verifies); evaluate a finished run (trend point, drift and
verification flags, alert); missed runs and catch-up; the trend.

Services take a session and never commit. Replay jobs and alert deliveries are enqueued with
`after_commit`, so nothing runs against rows that were rolled back.

One run per (schedule, due time): `start_audit_run` first claims the pair with an INSERT that the
unique key lets through once (see `repository.claim_run`); only the claimer samples traces and
creates the replay run, whose `idempotency_key` (`schedule:<id>:<due>`) is a second, independent
guard in the replay runs' own unique key.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Final, cast
from urllib.parse import urlsplit

from sqlalchemy.orm import Session

from replay_audit.audits import repository, sampling, webhook
from replay_audit.audits.drift import DriftRules, detect_drift, run_metrics
from replay_audit.audits.metrics import (
    DEFAULT_ALPHA,
    DEFAULT_MIN_N,
    RunMetrics,
    VerificationMetrics,
)
from replay_audit.audits.models import AuditAlert, AuditRun, AuditSchedule
from replay_audit.audits.schedule import due_times, latest_due, next_due
from replay_audit.audits.schemas import (
    AlertRead,
    AttemptRead,
    AuditRunRead,
    Missed,
    ScheduleCreate,
    ScheduleRead,
    ScheduleReplay,
    ScheduleUpdate,
    ScheduleVerify,
    Selection,
    Trend,
    TrendPoint,
    check_verified_sample,
)
from replay_audit.audits.webhook import DestinationPolicy
from replay_audit.db.base import flush_unique, read_model, utcnow
from replay_audit.db.ids import new_public_id
from replay_audit.db.unit_of_work import after_commit
from replay_audit.exceptions import (
    Conflict,
    FieldError,
    NotFound,
    QueueUnavailable,
    ReplayAuditError,
)
from replay_audit.json_value import JsonObject
from replay_audit.queue import Capabilities, JobQueue, JobSpec, Runner
from replay_audit.replays import service as replay_service
from replay_audit.replays import statistics as replay_statistics
from replay_audit.replays.models import MAX_RUN_NAME, ReplayRun
from replay_audit.replays.service import RunDefaults
from replay_audit.telemetry.metric import DRIFT_ALERTS
from replay_audit.traces.models import Trace
from replay_audit.verifications import service as verification_service
from replay_audit.verifications.models import Verification

#: How far back missed runs are looked for.
MISSED_LOOKBACK: Final = timedelta(days=31)
#: A due time younger than this is not missed yet: the next tick will start it.
MISSED_GRACE: Final = timedelta(minutes=10)
#: Most missed due times listed.
MAX_MISSED: Final = 1000
#: Most candidates loaded per run; a larger window is subsampled systematically by trace id
#: (ids congruent to a seeded offset modulo a stride) before the policy samples from it.
MAX_CANDIDATES: Final = 100_000
#: low_margin_first reads the logits of at most this many candidates (a uniform pool of
#: LOW_MARGIN_POOL_FACTOR x the sample size, at least LOW_MARGIN_POOL_MIN).
LOW_MARGIN_POOL_FACTOR: Final = 20
LOW_MARGIN_POOL_MIN: Final = 2_000
LOW_MARGIN_POOL_MAX: Final = 20_000
#: The queue of the light audit jobs (ticks, webhook deliveries) under RQ.
AUDIT_QUEUE: Final = "audit"
#: Validation context of a stored schedule's JSON (an older release's form is still read).
STORED: Final = {"stored": True}


def idempotency_key(schedule_public_id: str, due_at: datetime) -> str:
    """The replay run's idempotency key for one due time of a schedule."""
    return f"schedule:{schedule_public_id}:{due_at.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


def run_name(schedule_name: str, due_at: datetime) -> str:
    """The name of the replay run of one due time: the schedule's name and the due time (UTC),
    cut to the longest run name."""
    when = f" {due_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC"
    # One line whatever the schedule's name holds (a run name has no control characters).
    one_line = "".join(" " if ord(c) < 32 or ord(c) == 127 else c for c in schedule_name)
    return one_line[: MAX_RUN_NAME - len(when)].strip() + when


def mask_url(url: str | None) -> str | None:
    """Scheme and host only: what a non-admin may see of a webhook URL."""
    if url is None:
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}/..."


# --- schedules -------------------------------------------------------------------------------


def _name_taken(name: str | None) -> Conflict:
    return Conflict(f"a schedule named {name!r} exists in this project", field="name")


def create_schedule(
    session: Session,
    project_id: int,
    body: ScheduleCreate,
    *,
    capabilities: Capabilities,
    destinations: DestinationPolicy = webhook.STRICT,
    now: datetime | None = None,
) -> AuditSchedule:
    """Store a schedule. Its first due time is the first one after `now`: due times before
    creation are neither run nor missed. A webhook gets its signing secret
    (`schedule.webhook_secret`, for the caller to show once); an obviously internal webhook
    destination is refused (FieldError, see `webhook.check_url`)."""
    replay_service.check_targets(
        capabilities, [t.to_domain() for t in body.replay.targets], field="replay.targets"
    )
    if body.verify is not None:
        refusal = replay_service.target_refusal(
            capabilities, lm_head_dtype=None, device=body.verify.device
        )
        if refusal is not None:
            raise FieldError(refusal, field="verify.device")
    webhook_url = None if body.webhook_url is None else str(body.webhook_url)
    if webhook_url is not None:
        webhook.check_url(webhook_url, destinations)
    if repository.get_schedule_by_name(session, project_id, body.name) is not None:
        raise _name_taken(body.name)
    now = now or utcnow()
    schedule = AuditSchedule(
        public_id=new_public_id("as"),
        project_id=project_id,
        name=body.name,
        cron=body.cron,
        status=body.status,
        selection=body.selection.model_dump(mode="json"),
        sample_size=body.sample_size,
        policy=body.policy,
        seed=body.seed,
        replay=body.replay.model_dump(mode="json"),
        ear_drop_points=body.ear_drop_points,
        verify=None if body.verify is None else body.verify.model_dump(mode="json"),
        webhook_url=webhook_url,
        webhook_secret=None if webhook_url is None else webhook.new_secret(),
        active_since=now,
        paused_at=now if body.status == "paused" else None,
        created_at=now,
        updated_at=now,
    )
    if not flush_unique(session, schedule):  # a concurrent request took the name first
        raise _name_taken(body.name)
    return schedule


def get_schedule(session: Session, project_id: int, public_id: str) -> AuditSchedule:
    schedule = repository.get_schedule(session, project_id, public_id)
    if schedule is None:
        raise NotFound(f"no audit schedule {public_id!r}")
    return schedule


def update_schedule(
    session: Session,
    schedule: AuditSchedule,
    body: ScheduleUpdate,
    *,
    destinations: DestinationPolicy = webhook.STRICT,
    now: datetime | None = None,
) -> str | None:
    """Apply the fields sent. Resuming resets `active_since`: due times while paused are
    skipped, not missed. Returns the webhook's new signing secret when this change made one
    (rotation, or a webhook added to a schedule without one), for the caller to show once."""
    now = now or utcnow()
    sent = body.model_fields_set
    new_secret = None
    if "webhook_url" in sent:
        if body.webhook_url is None:
            schedule.webhook_url, schedule.webhook_secret = None, None
        else:
            webhook.check_url(str(body.webhook_url), destinations)
            schedule.webhook_url = str(body.webhook_url)
    if schedule.webhook_url is not None and (
        schedule.webhook_secret is None or body.rotate_webhook_secret
    ):
        new_secret = schedule.webhook_secret = webhook.new_secret()
    elif body.rotate_webhook_secret:
        raise FieldError(
            "the schedule has no webhook whose secret to rotate", field="rotate_webhook_secret"
        )
    if "name" in sent and body.name is not None and body.name != schedule.name:
        if repository.get_schedule_by_name(session, schedule.project_id, body.name) is not None:
            raise _name_taken(body.name)
        schedule.name = body.name
    if "status" in sent and body.status is not None and body.status != schedule.status:
        if body.status == "paused":
            schedule.paused_at = now
        else:
            schedule.active_since, schedule.paused_at = now, None
        schedule.status = body.status
    if "sample_size" in sent and body.sample_size is not None:
        check_verified_sample(body.sample_size, schedule_verify(schedule))
        schedule.sample_size = body.sample_size
    if "ear_drop_points" in sent and body.ear_drop_points is not None:
        schedule.ear_drop_points = body.ear_drop_points
    schedule.updated_at = now
    if not flush_unique(session, schedule):  # a concurrent request took the new name first
        raise _name_taken(body.name)
    return new_secret


def delete_schedule(session: Session, schedule: AuditSchedule) -> None:
    """Delete the schedule, its audit runs and alerts. Its replay runs stay (they are ordinary
    runs, still tagged with the schedule id)."""
    session.delete(schedule)
    session.flush()


def schedule_verify(schedule: AuditSchedule) -> ScheduleVerify | None:
    """The schedule's verification options (None: its runs are not verified)."""
    return None if schedule.verify is None else ScheduleVerify.model_validate(schedule.verify)


def to_reads(
    session: Session,
    schedules: list[AuditSchedule],
    *,
    reveal_webhook: bool,
    now: datetime | None = None,
) -> list[ScheduleRead]:
    """The API view of schedules (with next due time, last run and missed count)."""
    now = now or utcnow()
    names = repository.project_names(session, {s.project_id for s in schedules})
    last = repository.last_runs(session, [s.id for s in schedules])
    last_reads = dict(zip(last, runs_to_read(session, list(last.values()), schedules), strict=True))
    return [
        read_model(
            ScheduleRead,
            s,
            id=s.public_id,
            project=names.get(s.project_id, ""),
            selection=Selection.model_validate(s.selection),
            replay=ScheduleReplay.model_validate(s.replay, context=STORED),
            verify=schedule_verify(s),
            webhook_url=s.webhook_url if reveal_webhook else mask_url(s.webhook_url),
            next_due_at=next_due(s.cron, now) if s.status == "active" else None,
            last_run=last_reads.get(s.id),
            missed=len(missed_due_times(session, s, now=now)[0]),
        )
        for s in schedules
    ]


# --- starting runs ---------------------------------------------------------------------------


def _low_margin_pool(sample_size: int) -> int:
    return min(max(LOW_MARGIN_POOL_FACTOR * sample_size, LOW_MARGIN_POOL_MIN), LOW_MARGIN_POOL_MAX)


def _candidates(
    session: Session,
    schedule: AuditSchedule,
    start: datetime,
    end: datetime,
    seed_material: str,
) -> tuple[list[sampling.Candidate], int]:
    selection = Selection.model_validate(schedule.selection).to_selection(start, end)
    n = repository.count_candidates(session, schedule.project_id, selection)
    if n == 0:
        return [], 0
    stride = math.ceil(n / MAX_CANDIDATES)
    offset = int(sampling.unit(seed_material, "stride") * stride) if stride > 1 else 0
    pool = repository.candidates(
        session, schedule.project_id, selection, stride=stride, offset=offset
    )
    if schedule.policy == "low_margin_first":
        pool = sampling.presample(pool, _low_margin_pool(schedule.sample_size), seed_material)
        margins = repository.min_margins(session, [c.trace_id for c in pool])
        pool = [replace(c, min_margin=margins.get(c.trace_id)) for c in pool]
    return pool, n


def start_audit_run(
    session: Session,
    schedule: AuditSchedule,
    due_at: datetime,
    trigger: str,
    *,
    queue: JobQueue,
    defaults: RunDefaults,
) -> tuple[AuditRun, bool]:
    """The audit run of (schedule, due_at): created now, or the one that exists (created False).

    The window is relative to the due time, not to when the run starts, so a late or caught-up
    run samples what the punctual one would have. A replay or verification request its service
    refuses gives a `failed` run with the reason and nothing created (later ticks do not retry
    it). A queue that cannot take work raises `QueueUnavailable`: the caller's rollback drops the
    claim, so the run starts again once the queue is back, never left failed."""
    due_at = due_at.astimezone(UTC)
    window_start, window_end = Selection.model_validate(schedule.selection).window(due_at)
    now = utcnow()
    run_id = repository.claim_run(
        session,
        {
            "public_id": new_public_id("ar"),
            "schedule_id": schedule.id,
            "due_at": due_at,
            "trigger": trigger,
            "status": "running",
            "window_start": window_start,
            "window_end": window_end,
            "n_candidates": 0,
            "n_sampled": 0,
            "flags": [],
            "created_at": now,
        },
    )
    if run_id is None:
        existing = repository.get_run_by_due(session, schedule.id, due_at)
        assert existing is not None  # the conflicting row, committed before we could insert
        return existing, False
    run = session.get(AuditRun, run_id)
    assert run is not None

    seed_material = sampling.sample_seed(schedule.seed, due_at)
    pool, n = _candidates(session, schedule, run.window_start, run.window_end, seed_material)
    policy = cast(sampling.Policy, schedule.policy)  # the CHECK constraint's values
    chosen = sampling.sample(pool, schedule.sample_size, policy, seed_material)
    run.n_candidates, run.n_sampled = n, len(chosen)
    if not chosen:
        run.status, run.evaluated_at = "no_traces", now
        return run, True
    key = idempotency_key(schedule.public_id, due_at)
    ids = [c.public_id for c in chosen]
    request = ScheduleReplay.model_validate(schedule.replay, context=STORED).to_request(
        ids, key, run_name(schedule.name, due_at)
    )
    verify = schedule_verify(schedule)
    verification = None if verify is None else verify.to_request(ids, key)
    verified: list[Trace] | None = None
    try:
        # Both requests are checked before either is stored: a refusal leaves nothing behind.
        if verification is not None:
            verified = verification_service.select_traces(
                session, schedule.project_id, verification, queue.capabilities
            )
        replay, _ = replay_service.create_replay(
            session,
            schedule.project_id,
            request,
            queue,
            defaults=defaults,
            schedule_id=schedule.public_id,
        )
    except QueueUnavailable:
        raise
    except ReplayAuditError as e:
        # Refused before anything was written (see replays.service.create_replay and
        # verifications.service.select_traces): keep the claim, record why, and let the page
        # show it.
        replay_refused = verification is None or verified is not None
        run.status, run.evaluated_at = "failed", now
        run.error = e.message if replay_refused else f"the sample's verification: {e.message}"
        return run, True
    run.replay_run_id = replay.id
    if verification is not None:
        v, _ = verification_service.create_verification(
            session, schedule.project_id, verification, queue, traces=verified
        )
        run.verification_id = v.id
    session.flush()
    return run, True


def run_now(
    session: Session,
    schedule: AuditSchedule,
    *,
    queue: JobQueue,
    defaults: RunDefaults,
    now: datetime | None = None,
) -> tuple[AuditRun, bool]:
    """Start a run due now, paused or not. "Now" is rounded up to the whole second, so the
    window takes in every trace logged before the call, and two calls within one second are
    one run."""
    now = (now or utcnow()).astimezone(UTC)
    due = now.replace(microsecond=0) + (timedelta(seconds=1) if now.microsecond else timedelta())
    return start_audit_run(session, schedule, due, "manual", queue=queue, defaults=defaults)


def missed_due_times(
    session: Session, schedule: AuditSchedule, *, now: datetime | None = None
) -> tuple[list[datetime], datetime, bool]:
    """(due times with no run, oldest first; where the search started; truncated?).

    Looked for between the later of `active_since` and MISSED_LOOKBACK ago, and MISSED_GRACE
    ago (or when the schedule was paused)."""
    now = now or utcnow()
    since = max(schedule.active_since, now - MISSED_LOOKBACK)
    end = now - MISSED_GRACE
    if schedule.paused_at is not None:
        end = min(end, schedule.paused_at)
    if end < since:
        return [], since, False
    due = due_times(schedule.cron, since, end, limit=MAX_MISSED + 1)
    truncated = len(due) > MAX_MISSED
    due = due[-MAX_MISSED:]
    if not due:
        return [], since, False
    have = repository.due_times_with_runs(session, schedule.id, due[0], due[-1])
    return [d for d in due if d not in have], since, truncated


def missed(session: Session, schedule: AuditSchedule, *, now: datetime | None = None) -> Missed:
    due, since, truncated = missed_due_times(session, schedule, now=now)
    return Missed(schedule_id=schedule.public_id, due_at=due, since=since, truncated=truncated)


def catch_up(
    session: Session,
    schedule: AuditSchedule,
    *,
    limit: int,
    queue: JobQueue,
    defaults: RunDefaults,
    now: datetime | None = None,
) -> tuple[list[AuditRun], int]:
    """Start runs for the newest `limit` missed due times; (the runs, how many are left)."""
    due, _, _ = missed_due_times(session, schedule, now=now)
    todo = due[::-1][:limit]
    runs = [
        start_audit_run(session, schedule, d, "catch_up", queue=queue, defaults=defaults)[0]
        for d in todo
    ]
    return runs, len(due) - len(todo)


def due_now(
    schedule: AuditSchedule, latest_claimed: datetime | None, now: datetime
) -> datetime | None:
    """The due time a tick at `now` should start for this schedule, if any: the newest one,
    if it is not before `active_since` and has no run yet. Older due times without runs are
    missed, left to a catch-up by hand."""
    if schedule.status != "active":
        return None
    due = latest_due(schedule.cron, now)
    if due < schedule.active_since:
        return None
    if latest_claimed is not None and latest_claimed >= due:
        return None
    return due


# --- evaluation and alerts -------------------------------------------------------------------


def alert_job_spec(alert_id: int, *, timeout_s: float, retry_intervals_s: list[int]) -> JobSpec:
    """The one way an alert delivery is named and enqueued."""
    return JobSpec(
        func="replay_audit.audits.tasks.deliver_alert",
        args=(alert_id,),
        job_id=f"audit-alert-{alert_id}",
        queue=AUDIT_QUEUE,
        timeout_s=int(timeout_s) + 30,
        retry_intervals_s=tuple(retry_intervals_s),
    )


def _payload(
    alert_public_id: str,
    project: str,
    schedule: AuditSchedule,
    run: AuditRun,
    replay_public_id: str | None,
) -> JsonObject:
    """The webhook's JSON body: each flag whole (kind, comparison index and label, the test
    with its counts, p-value and alpha; or the group and its verdict now and before; the
    message), the run's headline numbers and its verification's verdicts."""
    m = run.metrics or RunMetrics()
    v = m.verification
    return {
        "event": "replay_audit.audit.drift",
        "alert_id": alert_public_id,
        "project": project,
        "schedule": {"id": schedule.public_id, "name": schedule.name, "cron": schedule.cron},
        "audit_run": {
            "id": run.public_id,
            "due_at": run.due_at.astimezone(UTC).isoformat(),
            "trigger": run.trigger,
            "replay_run_id": replay_public_id,
            "verification_id": None if v is None else v.id,
            "n_sampled": run.n_sampled,
        },
        "flags": [f.model_dump(mode="json", by_alias=True) for f in run.flags],
        "metrics": m.model_dump(
            mode="json",
            include={
                "ear",
                "ear_low",
                "ear_high",
                "c_lift",
                "trigger_rate",
                "categories",
                "self_agreement",
            },
        ),
        "verification": None if v is None else v.model_dump(mode="json"),
    }


def verification_metrics(verification: Verification | None) -> VerificationMetrics | None:
    """What a run keeps of its finished verification: the verdict of each group (None while it
    runs). A verification deleted since is a failed one."""
    if verification is None:
        return VerificationMetrics(status="failed", error="the verification was deleted")
    if verification.status not in ("done", "failed"):
        return None
    report = verification.report
    if verification.status == "failed" or report is None:
        return VerificationMetrics(
            id=verification.public_id, status="failed", error=verification.error
        )
    return VerificationMetrics.model_validate(
        {
            "id": verification.public_id,
            "status": "done",
            "verdict": report.get("verdict"),
            "groups": report.get("groups") or [],
        }
    )


def evaluate_audit_run(
    session: Session,
    audit_run_id: int,
    *,
    alert_runner: Runner,
    webhook_timeout_s: float,
    webhook_retry_intervals_s: list[int],
    drift_alpha: float = DEFAULT_ALPHA,
    drift_min_n: int = DEFAULT_MIN_N,
) -> AuditRun | None:
    """Give a run whose replay run (and verification, if any) has finished its trend point and
    flags (`drift.detect_drift`), and enqueue its webhook alert after commit if flagged. None
    when there is nothing to do (evaluated by another scheduler, or still going)."""
    run = repository.lock_run(session, audit_run_id)
    if run is None or run.status != "running":
        return None
    now = utcnow()
    replay = session.get(ReplayRun, run.replay_run_id) if run.replay_run_id is not None else None
    if replay is None:
        run.status, run.error, run.evaluated_at = "failed", "the replay run was deleted", now
        return run
    if replay.status not in ("done", "failed"):
        return None
    schedule = session.get(AuditSchedule, run.schedule_id)
    assert schedule is not None  # FK
    verified = None
    if schedule.verify is not None:
        verification = (
            session.get(Verification, run.verification_id)
            if run.verification_id is not None
            else None
        )
        verified = verification_metrics(verification)
        if verified is None:
            return None  # the verification is still going
    metrics = run_metrics(replay_statistics.of_run(session, replay), replay.run_targets)
    run.metrics = metrics.model_copy(update={"verification": verified})
    if replay.status == "failed":
        run.status, run.error, run.flags = "failed", replay.error, []
    else:
        history = repository.history_metrics(session, schedule.id, run.due_at)
        rules = DriftRules(schedule.ear_drop_points, alpha=drift_alpha, min_n=drift_min_n)
        run.flags = detect_drift(run.metrics, history, rules)
        run.status = "done"
        if verified is not None and verified.status == "failed":
            run.error = f"the sample's verification failed: {verified.error or 'no reason given'}"
    run.evaluated_at = now
    session.flush()
    if run.flags:
        after_commit(session, DRIFT_ALERTS.inc)
    if run.flags and schedule.webhook_url:
        public_id = new_public_id("al")
        project = repository.project_names(session, [schedule.project_id]).get(
            schedule.project_id, ""
        )
        alert_id = repository.add_alert(
            session,
            {
                "public_id": public_id,
                "audit_run_id": run.id,
                "url": schedule.webhook_url,
                "payload": _payload(public_id, project, schedule, run, replay.public_id),
                "status": "pending",
                "attempts": 0,
                "attempt_log": [],
                "created_at": now,
            },
        )
        if alert_id is not None:
            spec = alert_job_spec(
                alert_id, timeout_s=webhook_timeout_s, retry_intervals_s=webhook_retry_intervals_s
            )
            after_commit(session, lambda: alert_runner.enqueue(spec))
    return run


def alert_to_read(alert: AuditAlert, run_public_id: str, *, reveal_url: bool) -> AlertRead:
    return read_model(
        AlertRead,
        alert,
        id=alert.public_id,
        audit_run_id=run_public_id,
        url=alert.url if reveal_url else (mask_url(alert.url) or ""),
        attempt_log=[AttemptRead.model_validate(a) for a in alert.attempt_log or []],
    )


# --- trend -----------------------------------------------------------------------------------


def trend(session: Session, schedule: AuditSchedule, *, limit: int = 90) -> Trend:
    """The schedule's newest `limit` runs, oldest first, one point each (the chart's data)."""
    points = []
    for run, replay_id, _ in repository.runs_with_replay(
        session, schedule.id, limit=limit, newest_first=False
    ):
        m = run.metrics or RunMetrics()
        flags = list(run.flags or [])
        figures = {  # the run's metrics of the point's field names (its verification too)
            f: getattr(m, f) for f in RunMetrics.model_fields if f in TrendPoint.model_fields
        }
        points.append(
            read_model(
                TrendPoint,
                run,
                **figures,
                audit_run_id=run.public_id,
                date=run.due_at.astimezone(UTC).date().isoformat(),
                replay_run_id=replay_id,
                flags=flags,
                flagged=bool(flags),
            )
        )
    return Trend(schedule_id=schedule.public_id, points=points)


# --- reads for the handlers (they never touch the repository) ---------------------------------


def list_schedules(session: Session, project_id: int) -> list[AuditSchedule]:
    """The project's schedules."""
    return repository.list_schedules(session, project_id)


def runs_to_read(
    session: Session, runs: Sequence[AuditRun], schedules: Iterable[AuditSchedule]
) -> list[AuditRunRead]:
    """`runs` (of `schedules`) as the API shows them, with their replay runs' and
    verifications' ids and statuses."""
    schedule_ids = {s.id: s.public_id for s in schedules}
    replays = repository.refs(
        session, ReplayRun, [r.replay_run_id for r in runs if r.replay_run_id]
    )
    verifications = repository.refs(
        session, Verification, [r.verification_id for r in runs if r.verification_id]
    )
    reads = []
    for r in runs:
        replay_id, replay_status = replays.get(r.replay_run_id or -1, (None, None))
        verification_id, verification_status = verifications.get(
            r.verification_id or -1, (None, None)
        )
        reads.append(
            read_model(
                AuditRunRead,
                r,
                id=r.public_id,
                schedule_id=schedule_ids[r.schedule_id],
                replay_run_id=replay_id,
                replay_status=replay_status,
                verification_id=verification_id,
                verification_status=verification_status,
                flags=list(r.flags or []),
            )
        )
    return reads


def runs_page(
    session: Session, schedule: AuditSchedule, *, limit: int, before: datetime | None
) -> list[AuditRunRead]:
    """The schedule's runs, newest due time first (`before`: older than this due time)."""
    rows = repository.runs_with_replay(session, schedule.id, limit=limit, before=before)
    return runs_to_read(session, [r for r, _, _ in rows], [schedule])


def alerts(
    session: Session, schedule: AuditSchedule, *, limit: int, reveal_url: bool
) -> list[AlertRead]:
    """Webhook deliveries of the schedule's drift alerts, newest first."""
    return [
        alert_to_read(a, pid, reveal_url=reveal_url)
        for a, pid in repository.alerts_of_schedule(session, schedule.id, limit=limit)
    ]


def last_run_times(session: Session) -> dict[str, datetime]:
    """Per active schedule (by public id) that has run, the due time of its newest run: what
    `replay_audit_audit_last_run_timestamp_seconds` shows, so an operator sees whether last
    night's audit ran."""
    schedules = repository.active_schedules(session)
    runs = repository.last_runs(session, [s.id for s in schedules])
    return {s.public_id: runs[s.id].due_at for s in schedules if s.id in runs}
