"""The columns every request that runs as a background job stores (replay runs, screenings,
verifications): its public id, project, status, the request as accepted, idempotency key,
error and times, with the constraints that go with them. A mixin of the declarative models:
each table gets its own copy of the columns and constraints. Below it, the SQL every such table
shares: its lookups, its latest rows, and the idempotent insert."""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import JSON, CheckConstraint, ForeignKey, String, Text, UniqueConstraint, select
from sqlalchemy.orm import Mapped, Session, declared_attr, mapped_column

from replay_audit.db.base import flush_unique, utcnow
from replay_audit.db.types import BigId
from replay_audit.exceptions import Conflict, NotFound
from replay_audit.json_value import JsonObject


class JobRow:
    """A job's row: one request per (project, idempotency key), in one of four states."""

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[Any, ...]:
        return (
            UniqueConstraint("project_id", "idempotency_key"),
            CheckConstraint("status IN ('queued', 'running', 'done', 'failed')", name="status"),
        )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    public_id: Mapped[str] = mapped_column(String(40), unique=True)
    project_id: Mapped[int] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), index=True
    )
    status: Mapped[str] = mapped_column(String(16), default="queued")
    #: The request as accepted (canonical JSON of the domain's `...Create`).
    request: Mapped[JsonObject] = mapped_column(JSON)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)


Job = TypeVar("Job", bound=JobRow)


def get_by_public_id(
    model: type[Job], s: Session, project_id: int, public_id: str, missing: str
) -> Job:
    """The project's row of `model` with this public id, or NotFound saying `missing` (another
    project's answers the same)."""
    row = s.scalar(select(model).filter_by(project_id=project_id, public_id=public_id))
    if row is None:
        raise NotFound(missing)
    return row


def get_by_idempotency_key(model: type[Job], s: Session, project_id: int, key: str) -> Job | None:
    return s.scalar(select(model).filter_by(project_id=project_id, idempotency_key=key))


def recent(model: type[Job], s: Session, project_id: int, limit: int) -> list[Job]:
    """The project's `limit` latest rows of `model`, newest first."""
    stmt = select(model).filter_by(project_id=project_id)
    return list(s.scalars(stmt.order_by(model.created_at.desc(), model.id.desc()).limit(limit)))


def unfinished(model: type[Job], s: Session) -> list[Job]:
    """The rows the database says are not finished (a reconciler's work list), oldest first."""
    stmt = select(model).where(model.status.in_(("queued", "running")))
    return list(s.scalars(stmt.order_by(model.id)))


def insert_once(s: Session, row: Job, what: str) -> tuple[Job, bool]:
    """Insert `row`: (row, True). When a concurrent request took its idempotency key first,
    nothing is inserted: (the row that request stored, False), or a Conflict (409) naming
    `what` if that row cannot be read yet."""
    if flush_unique(s, row):
        return row, True
    key = row.idempotency_key
    existing = key and get_by_idempotency_key(type(row), s, row.project_id, key)
    if not existing:
        raise Conflict(
            f"a concurrent request is storing this {what}; retry", field="idempotency_key"
        )
    return existing, False
