"""The columns every request that runs as a background job stores (replay runs, screenings,
verifications): its public id, project, status, the request as accepted, idempotency key,
error and times, with the constraints that go with them. A mixin of the declarative models:
each table gets its own copy of the columns and constraints."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, CheckConstraint, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, declared_attr, mapped_column

from replay_audit.db.base import utcnow
from replay_audit.db.types import BigId
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
