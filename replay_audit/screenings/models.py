"""Screening tables.

screenings          one request: its plan, status, the report when done
screening_outputs   the sweep's `Store` (each prompt's decode in each run, the finished runs,
                    the probes): a killed or re-run job resumes from it, prompt by prompt
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

# The table its foreign keys name (projects), in the metadata whoever imports this.
import replay_audit.auth.models  # noqa: F401
from replay_audit.db.base import Base, utcnow
from replay_audit.db.jobs import JobRow
from replay_audit.db.types import BigId
from replay_audit.json_value import JsonObject


class Screening(JobRow, Base):
    __tablename__ = "screenings"

    model_sha256: Mapped[str] = mapped_column(String(64))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    #: Until when the job running it holds the row (`db.job_row.leased`); None: no job.
    lease_until: Mapped[datetime | None] = mapped_column(nullable=True)
    #: The `screening.report.ScreeningReport` JSON, stored when the screening finishes.
    report: Mapped[JsonObject | None] = mapped_column(JSON, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class ScreeningOutput(Base):
    __tablename__ = "screening_outputs"
    __table_args__ = (UniqueConstraint("screening_id", "key"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    screening_id: Mapped[int] = mapped_column(
        ForeignKey("screenings.id", ondelete="CASCADE"), index=True
    )
    key: Mapped[str] = mapped_column(String(300))
    value: Mapped[JsonObject] = mapped_column(JSON)
