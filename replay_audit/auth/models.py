"""Tables: projects and their API keys."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Final

from sqlalchemy import CheckConstraint, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column, relationship

from replay_audit.db.base import Base, utcnow


class Role(enum.StrEnum):
    """What a key may do. Submitters write traces and start replays (write-only: they poll a
    run's status but read nothing stored or produced), auditors read, admins do both and manage
    keys and schedules. Every key is confined to its own project."""

    submitter = "submitter"
    auditor = "auditor"
    admin = "admin"


#: The roles that read what the service stores or produces: traces, replay results, statistics
#: (their lifts list trace ids), reports, exports, audit trends, the web UI. Not submitters: a
#: leaked ingest key exposes no prompts, outputs, replayed tokens or trace lists.
READER_ROLES: Final = (Role.auditor, Role.admin)


class Project(Base):
    """A tenant: every trace and key belongs to exactly one project."""

    __tablename__ = "projects"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    """An API key, stored hashed (`auth.service` says how a key is checked)."""

    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint("role IN ('submitter', 'auditor', 'admin')", name="role"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), index=True
    )
    role: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(200))
    lookup: Mapped[str] = mapped_column(String(32), unique=True)
    key_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column()

    project: Mapped[Project] = relationship(lazy="joined", innerjoin=True)
