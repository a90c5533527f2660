"""The life of a row a job owns (a screening, a verification): each run of the job claims one
attempt on it, and a job that cannot go on fails it saying why. Jobs are retried and may be
re-enqueued by `reconcile`, so a finished row is left alone and the attempts are capped."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol, TypeVar

from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope


class JobRow(Protocol):
    status: str
    attempts: int
    error: str | None
    started_at: datetime | None
    finished_at: datetime | None


Row = TypeVar("Row", bound=JobRow)


def claim_attempt(row: JobRow | None, max_attempts: int) -> bool:
    """Start one more attempt on `row` (running, its start time kept from the first). False,
    with nothing to run, when the row is gone or finished, or has used its `max_attempts`
    (then it is failed, saying so: a worker killed or crashing every time)."""
    if row is None or row.status in ("done", "failed"):
        return False
    if row.attempts >= max_attempts:
        row.status, row.finished_at = "failed", utcnow()
        row.error = f"gave up after {row.attempts} attempts (worker killed or crashing)"
        return False
    row.attempts += 1
    row.status = "running"
    row.started_at = row.started_at or utcnow()
    return True


def fail_row(url: str, model: type[Row], row_id: int, message: str) -> None:
    """Fail row `row_id` of `model` with `message`, in a transaction of its own (a done row is
    left alone)."""
    with session_scope(url) as s:
        row = s.get(model, row_id)
        if row is not None and row.status != "done":
            row.status, row.error, row.finished_at = "failed", message, utcnow()
