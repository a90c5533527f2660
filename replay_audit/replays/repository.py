"""All SQL of the replays domain. Never commits: the edge (request, job, CLI) does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from replay_audit.db.base import utcnow
from replay_audit.replays.aggregate import aggregate_run
from replay_audit.replays.models import ReplayJob, ReplayResult, ReplayRun
from replay_audit.traces.models import Trace


def _insert(session: Session) -> Any:
    return (postgresql if session.get_bind().dialect.name == "postgresql" else sqlite).insert


def get_run(session: Session, project_id: int, public_id: str) -> ReplayRun | None:
    return session.scalar(
        select(ReplayRun).where(
            ReplayRun.project_id == project_id, ReplayRun.public_id == public_id
        )
    )


def get_run_by_idempotency_key(session: Session, project_id: int, key: str) -> ReplayRun | None:
    return session.scalar(
        select(ReplayRun).where(
            ReplayRun.project_id == project_id, ReplayRun.idempotency_key == key
        )
    )


def add_run(session: Session, run: ReplayRun, chunks: Sequence[tuple[str, list[int]]]) -> list[int]:
    """Insert the run and one job per (queue, trace ids) chunk; the job ids, in chunk order."""
    session.add(run)
    session.flush()
    jobs = [
        ReplayJob(run_id=run.id, chunk=i, queue=queue, trace_ids=ids)
        for i, (queue, ids) in enumerate(chunks)
    ]
    session.add_all(jobs)
    session.flush()
    return [j.id for j in jobs]


def progress(session: Session, run: ReplayRun) -> tuple[int, int]:
    """(ok results, failed results) of a run."""
    rows = session.execute(
        select(ReplayResult.status, func.count())
        .where(ReplayResult.run_id == run.id)
        .group_by(ReplayResult.status)
    ).all()
    counts = {status: int(n) for status, n in rows}
    return counts.get("ok", 0), counts.get("failed", 0)


def missing_comparisons(
    session: Session, run_id: int, trace_id: int, n_comparisons: int
) -> list[int]:
    have = set(
        session.scalars(
            select(ReplayResult.comparison).where(
                ReplayResult.run_id == run_id, ReplayResult.trace_id == trace_id
            )
        )
    )
    return [c for c in range(n_comparisons) if c not in have]


def insert_results(
    session: Session, run_id: int, trace_id: int, rows: Sequence[dict[str, Any]]
) -> None:
    """Insert one trace's results; a (run, trace, comparison) already there is left alone."""
    if not rows:
        return
    now = utcnow()
    values = [{"run_id": run_id, "trace_id": trace_id, "created_at": now, **r} for r in rows]
    stmt = _insert(session)(ReplayResult).on_conflict_do_nothing(
        index_elements=["run_id", "trace_id", "comparison"]
    )
    session.execute(stmt, values)


def _lock_run(session: Session, run_id: int) -> ReplayRun:
    stmt = select(ReplayRun).where(ReplayRun.id == run_id)
    if session.get_bind().dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    run = session.scalar(stmt.execution_options(populate_existing=True))
    assert run is not None
    return run


def finish_job(session: Session, job_id: int) -> None:
    """Mark the job done; if no job of its run is left unfinished, finalise the run.

    The run row is locked first (PostgreSQL `FOR UPDATE`; SQLite write transactions are
    serialised by `BEGIN IMMEDIATE`), so of two jobs finishing at once exactly one sees the
    other's commit and finalises."""
    job = session.get(ReplayJob, job_id)
    if job is None:
        return
    run = _lock_run(session, job.run_id)
    job.status, job.updated_at, job.error = "done", utcnow(), None
    session.flush()
    left = session.scalar(
        select(func.count()).where(ReplayJob.run_id == run.id, ReplayJob.status != "done")
    )
    if left == 0:
        finalise_run(session, run)


def fail_job(session: Session, job_id: int, reason: str) -> None:
    """A job that will not be retried: its traces get failed results saying why."""
    job = session.get(ReplayJob, job_id)
    if job is None or job.status == "done":
        return
    run = _lock_run(session, job.run_id)
    for trace_id in job.trace_ids:
        missing = missing_comparisons(session, run.id, trace_id, len(run.comparisons))
        insert_results(
            session,
            run.id,
            trace_id,
            [{"comparison": c, "status": "failed", "error": reason, "detail": {}} for c in missing],
        )
    job.error = reason
    session.flush()
    finish_job(session, job_id)


def finalise_run(session: Session, run: ReplayRun) -> None:
    results = list(
        session.execute(
            select(
                ReplayResult.trace_id,
                ReplayResult.comparison,
                ReplayResult.status,
                ReplayResult.error,
                ReplayResult.exact_match,
                ReplayResult.first_divergence_step,
                ReplayResult.category,
                ReplayResult.margin_logged,
                ReplayResult.margin_logged_ulps,
                ReplayResult.margin_replay,
                ReplayResult.margin_replay_ulps,
                ReplayResult.gate_triggers,
                ReplayResult.n_steps,
                ReplayResult.mean_gap,
                ReplayResult.length_difference,
                ReplayResult.semantic_agree,
                Trace.public_id,
            )
            .join(Trace, Trace.id == ReplayResult.trace_id)
            .where(ReplayResult.run_id == run.id)
            .order_by(ReplayResult.trace_id, ReplayResult.comparison)
        ).mappings()
    )
    run.aggregate = aggregate_run([dict(r) for r in results], run.comparisons, run.targets)
    n_ok = sum(1 for r in results if r["status"] == "ok")
    run.finished_at = utcnow()
    if results and n_ok == 0:
        run.status = "failed"
        first = next(r["error"] for r in results if r["status"] == "failed")
        run.error = f"every item failed; first reason: {first}"
    else:
        run.status = "done"


def results_page(
    session: Session, run: ReplayRun, *, after: int | None, limit: int
) -> list[tuple[ReplayResult, str]]:
    stmt = (
        select(ReplayResult, Trace.public_id)
        .join(Trace, Trace.id == ReplayResult.trace_id)
        .where(ReplayResult.run_id == run.id)
        .order_by(ReplayResult.id)
        .limit(limit)
    )
    if after is not None:
        stmt = stmt.where(ReplayResult.id > after)
    return [(row[0], row[1]) for row in session.execute(stmt)]


def unfinished_jobs(session: Session) -> list[ReplayJob]:
    """Jobs the database says are not done (the reconciler's work list)."""
    return list(
        session.scalars(select(ReplayJob).where(ReplayJob.status != "done").order_by(ReplayJob.id))
    )


def touch_job(session: Session, job_id: int) -> None:
    session.execute(update(ReplayJob).where(ReplayJob.id == job_id).values(updated_at=utcnow()))
