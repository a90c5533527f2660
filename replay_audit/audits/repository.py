"""All SQL of the audits domain. Never commits: the edge (request, tick, job, CLI) does."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import TypeVar

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session
from typing_extensions import TypedDict

from replay_audit.audits.metrics import Flag, RunMetrics
from replay_audit.audits.models import Attempt, AuditAlert, AuditRun, AuditSchedule
from replay_audit.audits.sampling import Candidate, min_logged_margin
from replay_audit.auth.models import Project
from replay_audit.db.engine import dialect_insert
from replay_audit.json_value import JsonObject
from replay_audit.replays.models import ReplayRun
from replay_audit.traces import repository as traces_repository
from replay_audit.traces.models import NumericalConfigRow, Trace
from replay_audit.traces.selection import TraceSelection
from replay_audit.verifications.models import Verification

#: Trace rows whose logits are read per query (low_margin_first).
MARGIN_CHUNK = 500
_Row = TypeVar("_Row", AuditRun, AuditAlert)


def _locked(session: Session, model: type[_Row], row_id: int) -> _Row | None:
    """The row reloaded, and on PostgreSQL locked for update until the transaction ends."""
    stmt = select(model).where(model.id == row_id)
    if session.get_bind().dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    return session.scalar(stmt.execution_options(populate_existing=True))


# --- schedules -------------------------------------------------------------------------------


def get_schedule(session: Session, project_id: int, public_id: str) -> AuditSchedule | None:
    return session.scalar(
        select(AuditSchedule).where(
            AuditSchedule.project_id == project_id, AuditSchedule.public_id == public_id
        )
    )


def find_schedule(session: Session, public_id: str) -> AuditSchedule | None:
    """A schedule of any project (the operator's CLI)."""
    return session.scalar(select(AuditSchedule).where(AuditSchedule.public_id == public_id))


def get_schedule_by_name(session: Session, project_id: int, name: str) -> AuditSchedule | None:
    return session.scalar(
        select(AuditSchedule).where(
            AuditSchedule.project_id == project_id, AuditSchedule.name == name
        )
    )


def list_schedules(session: Session, project_id: int | None) -> list[AuditSchedule]:
    """A project's schedules (every project's with None), oldest first."""
    stmt = select(AuditSchedule).order_by(AuditSchedule.id)
    if project_id is not None:
        stmt = stmt.where(AuditSchedule.project_id == project_id)
    return list(session.scalars(stmt))


def project_names(session: Session, project_ids: Iterable[int]) -> dict[int, str]:
    ids = set(project_ids)
    if not ids:
        return {}
    rows = session.execute(select(Project.id, Project.name).where(Project.id.in_(ids))).all()
    return {pid: name for pid, name in rows}


def active_schedules(session: Session) -> list[AuditSchedule]:
    """Every project's active schedules (what a tick looks at)."""
    stmt = select(AuditSchedule).where(AuditSchedule.status == "active").order_by(AuditSchedule.id)
    return list(session.scalars(stmt))


def latest_scheduled_due(session: Session, schedule_ids: Sequence[int]) -> dict[int, datetime]:
    """Per schedule, the newest due time that has a run other than a manual one."""
    if not schedule_ids:
        return {}
    rows = session.execute(
        select(AuditRun.schedule_id, func.max(AuditRun.due_at))
        .where(AuditRun.schedule_id.in_(schedule_ids), AuditRun.trigger != "manual")
        .group_by(AuditRun.schedule_id)
    ).all()
    return {sid: due for sid, due in rows if due is not None}


# --- audit runs ------------------------------------------------------------------------------


class RunValues(TypedDict):
    """A new audit run's row."""

    public_id: str
    schedule_id: int
    due_at: datetime
    trigger: str
    status: str
    window_start: datetime
    window_end: datetime
    n_candidates: int
    n_sampled: int
    flags: list[Flag]
    created_at: datetime


def _insert_new(
    session: Session, model: type[_Row], values: RunValues | AlertValues, key: list[str]
) -> int | None:
    """Insert a row unless one with the same unique `key` exists: the new row's id, or None."""
    stmt = (
        dialect_insert(session)(model)
        .values(**values)
        .on_conflict_do_nothing(index_elements=key)
        .returning(model.id)
    )
    return session.execute(stmt).scalar_one_or_none()


def claim_run(session: Session, values: RunValues) -> int | None:
    """Insert an audit run unless its (schedule, due time) has one: the new row's id, or None.

    The unique key decides, not a lock held by this process: on PostgreSQL a concurrent
    claimer blocks on the index entry until the first commits, then inserts nothing."""
    return _insert_new(session, AuditRun, values, ["schedule_id", "due_at"])


def get_run_by_due(session: Session, schedule_id: int, due_at: datetime) -> AuditRun | None:
    return session.scalar(
        select(AuditRun).where(AuditRun.schedule_id == schedule_id, AuditRun.due_at == due_at)
    )


def get_run(session: Session, schedule_id: int, public_id: str) -> AuditRun | None:
    return session.scalar(
        select(AuditRun).where(AuditRun.schedule_id == schedule_id, AuditRun.public_id == public_id)
    )


def lock_run(session: Session, run_id: int) -> AuditRun | None:
    return _locked(session, AuditRun, run_id)


def runs_with_replay(
    session: Session,
    schedule_id: int,
    *,
    limit: int,
    newest_first: bool = True,
    before: datetime | None = None,
) -> list[tuple[AuditRun, str | None, str | None]]:
    """A schedule's audit runs with their replay run's public id and status."""
    stmt = (
        select(AuditRun, ReplayRun.public_id, ReplayRun.status)
        .outerjoin(ReplayRun, ReplayRun.id == AuditRun.replay_run_id)
        .where(AuditRun.schedule_id == schedule_id)
        .order_by(AuditRun.due_at.desc())
        .limit(limit)
    )
    if before is not None:
        stmt = stmt.where(AuditRun.due_at < before)
    rows: list[tuple[AuditRun, str | None, str | None]] = [
        (run, public_id, status) for run, public_id, status in session.execute(stmt)
    ]
    return rows if newest_first else rows[::-1]


def last_runs(session: Session, schedule_ids: Sequence[int]) -> dict[int, AuditRun]:
    """Per schedule, its run with the newest due time."""
    if not schedule_ids:
        return {}
    newest = (
        select(AuditRun.schedule_id, func.max(AuditRun.due_at).label("due_at"))
        .where(AuditRun.schedule_id.in_(schedule_ids))
        .group_by(AuditRun.schedule_id)
        .subquery()
    )
    rows = session.scalars(
        select(AuditRun).join(
            newest,
            and_(AuditRun.schedule_id == newest.c.schedule_id, AuditRun.due_at == newest.c.due_at),
        )
    )
    return {r.schedule_id: r for r in rows}


def refs(
    session: Session, model: type[ReplayRun] | type[Verification], ids: Iterable[int]
) -> dict[int, tuple[str, str]]:
    """Replay run (or verification) id -> (public id, status)."""
    wanted = set(ids)
    if not wanted:
        return {}
    stmt = select(model.id, model.public_id, model.status).where(model.id.in_(wanted))
    return {i: (pid, st) for i, pid, st in session.execute(stmt)}


def due_times_with_runs(
    session: Session, schedule_id: int, start: datetime, end: datetime
) -> set[datetime]:
    stmt = select(AuditRun.due_at).where(
        AuditRun.schedule_id == schedule_id, AuditRun.due_at.between(start, end)
    )
    return set(session.scalars(stmt))


def runs_to_evaluate(session: Session) -> list[int]:
    """Audit runs whose replay run, and verification if they have one, have finished but that
    carry no trend point yet."""
    finished = ("done", "failed")
    stmt = (
        select(AuditRun.id)
        .join(ReplayRun, ReplayRun.id == AuditRun.replay_run_id)
        .outerjoin(Verification, Verification.id == AuditRun.verification_id)
        .where(
            AuditRun.status == "running",
            ReplayRun.status.in_(finished),
            or_(AuditRun.verification_id.is_(None), Verification.status.in_(finished)),
        )
        .order_by(AuditRun.due_at)
    )
    return list(session.scalars(stmt))


def orphaned_runs(session: Session) -> list[int]:
    """Audit runs still 'running' whose replay run is gone."""
    stmt = select(AuditRun.id).where(AuditRun.status == "running", AuditRun.replay_run_id.is_(None))
    return list(session.scalars(stmt))


def history_metrics(session: Session, schedule_id: int, before: datetime) -> list[RunMetrics]:
    """Trend points of the schedule's evaluated runs due before `before`, oldest first."""
    stmt = select(AuditRun.metrics).where(
        AuditRun.schedule_id == schedule_id,
        AuditRun.status == "done",
        AuditRun.due_at < before,
        AuditRun.metrics.is_not(None),
    )
    return [m for m in session.scalars(stmt.order_by(AuditRun.due_at)) if m is not None]


# --- candidates ------------------------------------------------------------------------------


def count_candidates(session: Session, project_id: int, selection: TraceSelection) -> int:
    """How many of the project's traces `selection` (a run's window and filters) selects."""
    stmt = traces_repository.select_where(
        select(func.count()).select_from(Trace), project_id, selection
    )
    return int(session.scalar(stmt) or 0)


def candidates(
    session: Session,
    project_id: int,
    selection: TraceSelection,
    *,
    stride: int = 1,
    offset: int = 0,
) -> list[Candidate]:
    """The traces `selection` selects (id order). With stride > 1 only ids congruent to
    `offset` modulo `stride`: a systematic subsample that bounds what a huge window loads."""
    stmt = traces_repository.select_where(
        select(Trace.id, Trace.public_id, Trace.model_name, NumericalConfigRow.public_id),
        project_id,
        selection,
    )
    if stride > 1:
        stmt = stmt.where(Trace.id % stride == offset)
    rows = session.execute(stmt.order_by(Trace.id)).all()
    return [Candidate(tid, pid, (model, cfg)) for tid, pid, model, cfg in rows]


def min_margins(session: Session, trace_ids: Sequence[int]) -> dict[int, float | None]:
    """Each trace's smallest logged top-2 margin (None without logged top-k)."""
    out: dict[int, float | None] = {}
    for i in range(0, len(trace_ids), MARGIN_CHUNK):
        chunk = trace_ids[i : i + MARGIN_CHUNK]
        rows = session.execute(
            select(Trace.id, Trace.top_k, Trace.top_k_logits).where(Trace.id.in_(chunk))
        ).all()
        for tid, k, logits in rows:
            out[tid] = min_logged_margin(logits, k)
    return out


# --- alerts ----------------------------------------------------------------------------------


class AlertValues(TypedDict):
    """A new alert's row."""

    public_id: str
    audit_run_id: int
    url: str
    payload: JsonObject
    status: str
    attempts: int
    attempt_log: list[Attempt]
    created_at: datetime


def add_alert(session: Session, values: AlertValues) -> int | None:
    """Insert the run's alert unless it has one: the new id, or None."""
    return _insert_new(session, AuditAlert, values, ["audit_run_id"])


def lock_alert(session: Session, alert_id: int) -> AuditAlert | None:
    return _locked(session, AuditAlert, alert_id)


def alert_webhook_secret(session: Session, alert_id: int) -> str | None:
    """The signing secret of the schedule the alert belongs to (read at each delivery, so a
    rotation applies to the retries that follow it)."""
    return session.scalar(
        select(AuditSchedule.webhook_secret)
        .join(AuditRun, AuditRun.schedule_id == AuditSchedule.id)
        .join(AuditAlert, AuditAlert.audit_run_id == AuditRun.id)
        .where(AuditAlert.id == alert_id)
    )


def pending_alerts(session: Session) -> list[int]:
    stmt = select(AuditAlert.id).where(AuditAlert.status == "pending").order_by(AuditAlert.id)
    return list(session.scalars(stmt))


def alerts_of_schedule(
    session: Session, schedule_id: int, *, limit: int
) -> list[tuple[AuditAlert, str]]:
    """The schedule's alerts, newest first, with their audit run's public id."""
    rows = session.execute(
        select(AuditAlert, AuditRun.public_id)
        .join(AuditRun, AuditRun.id == AuditAlert.audit_run_id)
        .where(AuditRun.schedule_id == schedule_id)
        .order_by(AuditAlert.id.desc())
        .limit(limit)
    ).all()
    return [(a, pid) for a, pid in rows]
