"""Replay runs, their jobs and their per-trace results.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 02:23:06.866460
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 64-bit keys on PostgreSQL; SQLite autoincrements only an INTEGER PRIMARY KEY.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:

    op.create_table(
        "replay_runs",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("public_id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("mode", sa.String(length=32), nullable=False),
        sa.Column("compare", sa.String(length=16), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("targets", sa.JSON(), nullable=False),
        sa.Column("comparisons", sa.JSON(), nullable=False),
        sa.Column("n_traces", sa.Integer(), nullable=False),
        sa.Column("n_items", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("schedule_id", sa.String(length=40), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("aggregate", sa.JSON(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=True),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'done', 'failed')", name=op.f("ck_replay_runs_status")
        ),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
            name=op.f("fk_replay_runs_project_id_projects"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replay_runs")),
        sa.UniqueConstraint(
            "project_id", "idempotency_key", name=op.f("uq_replay_runs_project_id_idempotency_key")
        ),
        sa.UniqueConstraint("public_id", name=op.f("uq_replay_runs_public_id")),
    )
    with op.batch_alter_table("replay_runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_replay_runs_created_at"), ["created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_replay_runs_project_id"), ["project_id"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_replay_runs_schedule_id"), ["schedule_id"], unique=False
        )

    op.create_table(
        "replay_jobs",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("run_id", BIG_ID, nullable=False),
        sa.Column("chunk", sa.Integer(), nullable=False),
        sa.Column("queue", sa.String(length=32), nullable=False),
        sa.Column("trace_ids", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("enqueued_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'done', 'failed')", name=op.f("ck_replay_jobs_status")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["replay_runs.id"],
            name=op.f("fk_replay_jobs_run_id_replay_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replay_jobs")),
        sa.UniqueConstraint("run_id", "chunk", name=op.f("uq_replay_jobs_run_id_chunk")),
    )
    with op.batch_alter_table("replay_jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_replay_jobs_run_id"), ["run_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_replay_jobs_status"), ["status"], unique=False)

    op.create_table(
        "replay_results",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("run_id", BIG_ID, nullable=False),
        sa.Column("trace_id", BIG_ID, nullable=False),
        sa.Column("comparison", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("exact_match", sa.Boolean(), nullable=True),
        sa.Column("first_divergence_step", sa.Integer(), nullable=True),
        sa.Column("category", sa.String(length=32), nullable=True),
        sa.Column("margin_logged", sa.Float(), nullable=True),
        sa.Column("margin_logged_ulps", sa.Float(), nullable=True),
        sa.Column("margin_logged_source", sa.String(length=32), nullable=True),
        sa.Column("margin_replay", sa.Float(), nullable=True),
        sa.Column("margin_replay_ulps", sa.Float(), nullable=True),
        sa.Column("gate_triggers", sa.Integer(), nullable=True),
        sa.Column("n_steps", sa.Integer(), nullable=True),
        sa.Column("trigger_rate", sa.Float(), nullable=True),
        sa.Column("mean_gap", sa.Float(), nullable=True),
        sa.Column("tie", sa.Boolean(), nullable=True),
        sa.Column("cascade_length", sa.Integer(), nullable=True),
        sa.Column("length_difference", sa.Integer(), nullable=True),
        sa.Column("semantic_agree", sa.Boolean(), nullable=True),
        sa.Column("output_b", sa.LargeBinary(), nullable=True),
        sa.Column("output_a", sa.LargeBinary(), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint("status IN ('ok', 'failed')", name=op.f("ck_replay_results_status")),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["replay_runs.id"],
            name=op.f("fk_replay_results_run_id_replay_runs"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["trace_id"],
            ["traces.id"],
            name=op.f("fk_replay_results_trace_id_traces"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replay_results")),
        sa.UniqueConstraint(
            "run_id",
            "trace_id",
            "comparison",
            name=op.f("uq_replay_results_run_id_trace_id_comparison"),
        ),
    )
    with op.batch_alter_table("replay_results", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_replay_results_category"), ["category"], unique=False)
        batch_op.create_index(batch_op.f("ix_replay_results_run_id"), ["run_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_replay_results_trace_id"), ["trace_id"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("replay_results", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_replay_results_trace_id"))
        batch_op.drop_index(batch_op.f("ix_replay_results_run_id"))
        batch_op.drop_index(batch_op.f("ix_replay_results_category"))

    op.drop_table("replay_results")
    with op.batch_alter_table("replay_jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_replay_jobs_status"))
        batch_op.drop_index(batch_op.f("ix_replay_jobs_run_id"))

    op.drop_table("replay_jobs")
    with op.batch_alter_table("replay_runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_replay_runs_schedule_id"))
        batch_op.drop_index(batch_op.f("ix_replay_runs_project_id"))
        batch_op.drop_index(batch_op.f("ix_replay_runs_created_at"))

    op.drop_table("replay_runs")
