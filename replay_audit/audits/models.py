"""Audit tables: schedules, their runs (one per schedule and due time) and the runs' webhook
alerts.

The replay run of an audit run is an ordinary `replay_runs` row (`schedule_id` = the schedule's
public id, `idempotency_key` = `schedule:<id>:<due time>`), so everything that shows a replay
run shows it; so is its verification, an ordinary `verifications` row with the same
idempotency key.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column
from typing_extensions import TypedDict

# The tables its foreign keys name (projects, replay_runs, verifications), in the metadata whoever
# imports this.
import replay_audit.auth.models
import replay_audit.replays.models
import replay_audit.verifications.models  # noqa: F401
from replay_audit.audits.metrics import Flag, RunMetrics
from replay_audit.db.base import Base, utcnow
from replay_audit.db.types import BigId, ModelJSON
from replay_audit.json_value import JsonObject


class AuditSchedule(Base):
    __tablename__ = "audit_schedules"
    __table_args__ = (
        UniqueConstraint("project_id", "name"),
        CheckConstraint("status IN ('active', 'paused')", name="status"),
        CheckConstraint("policy IN ('uniform', 'stratified', 'low_margin_first')", name="policy"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    public_id: Mapped[str] = mapped_column(String(40), unique=True)
    project_id: Mapped[int] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), index=True
    )
    name: Mapped[str] = mapped_column(String(200))
    #: Five-field cron expression, read in UTC.
    cron: Mapped[str] = mapped_column(String(100))
    status: Mapped[str] = mapped_column(String(16), default="active")
    #: `schemas.Selection` as JSON: tags, model, configuration, window.
    selection: Mapped[JsonObject] = mapped_column(JSON)
    sample_size: Mapped[int] = mapped_column(Integer)
    policy: Mapped[str] = mapped_column(String(32))
    seed: Mapped[int] = mapped_column(BigInteger)
    #: `schemas.ScheduleReplay` as JSON: targets, compare, mode, ...
    replay: Mapped[JsonObject] = mapped_column(JSON)
    ear_drop_points: Mapped[float] = mapped_column(Float)
    #: `schemas.ScheduleVerify` as JSON (None: the runs are not verified).
    verify: Mapped[JsonObject | None] = mapped_column(JSON, nullable=True)
    webhook_url: Mapped[str | None] = mapped_column(String(2000), nullable=True)
    #: The key that signs the webhook's deliveries (HMAC-SHA256), set with the webhook. Stored
    #: in clear because signing needs it (a hash could not sign); shown once, at creation or
    #: rotation, never read back through the API.
    webhook_secret: Mapped[str | None] = mapped_column(String(100), nullable=True)
    #: Due times before this are never run by the scheduler nor counted as missed: set at
    #: creation and again when a paused schedule is resumed.
    active_since: Mapped[datetime] = mapped_column(default=utcnow)
    #: When it was paused (None while active): due times after it are not missed.
    paused_at: Mapped[datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class AuditRun(Base):
    __tablename__ = "audit_runs"
    __table_args__ = (
        # Exactly one run per schedule per due time: two schedulers, a retried tick, a catch-up
        # racing the nightly run all meet here.
        UniqueConstraint("schedule_id", "due_at"),
        CheckConstraint("trigger IN ('scheduled', 'manual', 'catch_up')", name="trigger"),
        CheckConstraint("status IN ('running', 'done', 'no_traces', 'failed')", name="status"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    public_id: Mapped[str] = mapped_column(String(40), unique=True)
    schedule_id: Mapped[int] = mapped_column(
        ForeignKey("audit_schedules.id", ondelete="CASCADE"), index=True
    )
    due_at: Mapped[datetime] = mapped_column()
    trigger: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True)
    replay_run_id: Mapped[int | None] = mapped_column(
        ForeignKey("replay_runs.id", ondelete="SET NULL"), nullable=True, index=True
    )
    #: The verification of the run's sample (a schedule with `verify`).
    verification_id: Mapped[int | None] = mapped_column(
        BigId, ForeignKey("verifications.id", ondelete="SET NULL"), nullable=True, index=True
    )
    #: The trace window [window_start, window_end) the sample was drawn from.
    window_start: Mapped[datetime] = mapped_column()
    window_end: Mapped[datetime] = mapped_column()
    n_candidates: Mapped[int] = mapped_column(Integer, default=0)
    n_sampled: Mapped[int] = mapped_column(Integer, default=0)
    #: `drift.run_metrics` once the replay run finished (JSON).
    metrics: Mapped[RunMetrics | None] = mapped_column(ModelJSON(RunMetrics), nullable=True)
    #: `drift.detect_drift`'s flags (JSON): the comparisons' drift and the groups turned
    #: inconsistent.
    flags: Mapped[list[Flag]] = mapped_column(ModelJSON(list[Flag]), default=list)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    evaluated_at: Mapped[datetime | None] = mapped_column(nullable=True)


class Attempt(TypedDict):
    """A webhook delivery attempt as `AuditAlert.attempt_log` stores it: when (ISO 8601), and
    the answer's status code or `error`, one of `webhook.ERROR_CLASSES` (never the receiver's
    answer)."""

    at: str
    ok: bool
    status_code: int | None
    error: str | None


class AuditAlert(Base):
    __tablename__ = "audit_alerts"
    __table_args__ = (
        CheckConstraint("status IN ('pending', 'delivered', 'failed')", name="status"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    public_id: Mapped[str] = mapped_column(String(40), unique=True)
    #: One alert per flagged run (unique): a re-evaluation cannot POST twice.
    audit_run_id: Mapped[int] = mapped_column(
        ForeignKey("audit_runs.id", ondelete="CASCADE"), unique=True
    )
    url: Mapped[str] = mapped_column(String(2000))
    payload: Mapped[JsonObject] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    #: One entry per attempt.
    attempt_log: Mapped[list[Attempt]] = mapped_column(JSON, default=list)
    #: The last attempt's error class (`webhook.ERROR_CLASSES`).
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(nullable=True)
