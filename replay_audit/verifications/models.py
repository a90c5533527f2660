"""Verification tables.

verifications               one request: the traces it selected, status, the report when done
verification_calibrations   a benign null, measured once per key and reused by every later
                            verification that needs it
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Float, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

# The table its foreign keys name (projects), in the metadata whoever imports this.
import replay_audit.auth.models  # noqa: F401
from replay_audit.db.base import Base, utcnow
from replay_audit.db.jobs import JobRow
from replay_audit.db.types import BigId
from replay_audit.json_value import JsonObject


class Verification(JobRow, Base):
    __tablename__ = "verifications"

    #: The checkpoint every selected trace claims.
    model_sha256: Mapped[str] = mapped_column(String(64))
    #: The selection resolved at creation: the traces' ids, oldest first, and each one's group.
    selection: Mapped[JsonObject] = mapped_column(JSON)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    #: Until when the job running it holds the row (`db.job_row.leased`); None: no job.
    lease_until: Mapped[datetime | None] = mapped_column(nullable=True)
    #: `verifications.domain.report_json` with the calibrations and platforms, when done.
    report: Mapped[JsonObject | None] = mapped_column(JSON, nullable=True)


class VerificationCalibration(Base):
    __tablename__ = "verification_calibrations"
    __table_args__ = (
        # Named: the conventional name (every column's) is longer than PostgreSQL's 63.
        UniqueConstraint(
            "weights_sha256",
            "platform_key",
            "claim_key",
            "false_alarm_rate",
            name="uq_verification_calibrations_key",
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    weights_sha256: Mapped[str] = mapped_column(String(64))
    #: Canonical JSON of `null.platform_key` (device, GPU, SM, torch version).
    platform_key: Mapped[str] = mapped_column(String(400))
    #: Canonical JSON of `domain.claim_key` (body and head formats, attention kernel).
    claim_key: Mapped[str] = mapped_column(String(400))
    false_alarm_rate: Mapped[float] = mapped_column(Float)
    #: `stats.verification.Calibration.to_json()`.
    calibration: Mapped[JsonObject] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
