"""Audit schedules, their runs (unique per schedule and due time) and webhook alerts.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 02:44:23.845077
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 64-bit keys on PostgreSQL; SQLite autoincrements only an INTEGER PRIMARY KEY.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "audit_schedules",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("public_id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("cron", sa.String(length=100), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("selection", sa.JSON(), nullable=False),
        sa.Column("sample_size", sa.Integer(), nullable=False),
        sa.Column("policy", sa.String(length=32), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("replay", sa.JSON(), nullable=False),
        sa.Column("ear_drop_points", sa.Float(), nullable=False),
        sa.Column("webhook_url", sa.String(length=2000), nullable=True),
        sa.Column("active_since", TIMESTAMP, nullable=False),
        sa.Column("paused_at", TIMESTAMP, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint(
            "policy IN ('uniform', 'stratified', 'low_margin_first')",
            name=op.f("ck_audit_schedules_policy"),
        ),
        sa.CheckConstraint(
            "status IN ('active', 'paused')", name=op.f("ck_audit_schedules_status")
        ),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
            name=op.f("fk_audit_schedules_project_id_projects"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_schedules")),
        sa.UniqueConstraint("project_id", "name", name=op.f("uq_audit_schedules_project_id_name")),
        sa.UniqueConstraint("public_id", name=op.f("uq_audit_schedules_public_id")),
    )
    with op.batch_alter_table("audit_schedules", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_audit_schedules_project_id"), ["project_id"], unique=False
        )

    op.create_table(
        "audit_runs",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("public_id", sa.String(length=40), nullable=False),
        sa.Column("schedule_id", sa.Integer(), nullable=False),
        sa.Column("due_at", TIMESTAMP, nullable=False),
        sa.Column("trigger", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("replay_run_id", BIG_ID, nullable=True),
        sa.Column("window_start", TIMESTAMP, nullable=False),
        sa.Column("window_end", TIMESTAMP, nullable=False),
        sa.Column("n_candidates", sa.Integer(), nullable=False),
        sa.Column("n_sampled", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("flags", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("evaluated_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint(
            "status IN ('running', 'done', 'no_traces', 'failed')",
            name=op.f("ck_audit_runs_status"),
        ),
        sa.CheckConstraint(
            "trigger IN ('scheduled', 'manual', 'catch_up')", name=op.f("ck_audit_runs_trigger")
        ),
        sa.ForeignKeyConstraint(
            ["replay_run_id"],
            ["replay_runs.id"],
            name=op.f("fk_audit_runs_replay_run_id_replay_runs"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["schedule_id"],
            ["audit_schedules.id"],
            name=op.f("fk_audit_runs_schedule_id_audit_schedules"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_runs")),
        sa.UniqueConstraint("public_id", name=op.f("uq_audit_runs_public_id")),
        sa.UniqueConstraint("schedule_id", "due_at", name=op.f("uq_audit_runs_schedule_id_due_at")),
    )
    with op.batch_alter_table("audit_runs", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_audit_runs_replay_run_id"), ["replay_run_id"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_audit_runs_schedule_id"), ["schedule_id"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_audit_runs_status"), ["status"], unique=False)

    op.create_table(
        "audit_alerts",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("public_id", sa.String(length=40), nullable=False),
        sa.Column("audit_run_id", BIG_ID, nullable=False),
        sa.Column("url", sa.String(length=2000), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("attempt_log", sa.JSON(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("delivered_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'delivered', 'failed')", name=op.f("ck_audit_alerts_status")
        ),
        sa.ForeignKeyConstraint(
            ["audit_run_id"],
            ["audit_runs.id"],
            name=op.f("fk_audit_alerts_audit_run_id_audit_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_alerts")),
        sa.UniqueConstraint("audit_run_id", name=op.f("uq_audit_alerts_audit_run_id")),
        sa.UniqueConstraint("public_id", name=op.f("uq_audit_alerts_public_id")),
    )
    with op.batch_alter_table("audit_alerts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_alerts_status"), ["status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("audit_alerts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_alerts_status"))

    op.drop_table("audit_alerts")
    with op.batch_alter_table("audit_runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_runs_status"))
        batch_op.drop_index(batch_op.f("ix_audit_runs_schedule_id"))
        batch_op.drop_index(batch_op.f("ix_audit_runs_replay_run_id"))

    op.drop_table("audit_runs")
    with op.batch_alter_table("audit_schedules", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_schedules_project_id"))

    op.drop_table("audit_schedules")
