"""Verifications (`POST /v1/verifications`) and the calibrations (benign nulls) they reuse.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "verifications",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("public_id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("model_sha256", sa.String(length=64), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("selection", sa.JSON(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("report", sa.JSON(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=True),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'done', 'failed')",
            name=op.f("ck_verifications_status"),
        ),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
            name=op.f("fk_verifications_project_id_projects"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_verifications")),
        sa.UniqueConstraint(
            "project_id",
            "idempotency_key",
            name=op.f("uq_verifications_project_id_idempotency_key"),
        ),
        sa.UniqueConstraint("public_id", name=op.f("uq_verifications_public_id")),
    )
    with op.batch_alter_table("verifications", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_verifications_created_at"), ["created_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_verifications_project_id"), ["project_id"], unique=False
        )

    op.create_table(
        "verification_calibrations",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("weights_sha256", sa.String(length=64), nullable=False),
        sa.Column("platform_key", sa.String(length=400), nullable=False),
        sa.Column("claim_key", sa.String(length=400), nullable=False),
        sa.Column("false_alarm_rate", sa.Float(), nullable=False),
        sa.Column("calibration", sa.JSON(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_verification_calibrations")),
        sa.UniqueConstraint(
            "weights_sha256",
            "platform_key",
            "claim_key",
            "false_alarm_rate",
            name=op.f("uq_verification_calibrations_key"),
        ),
    )


def downgrade() -> None:
    op.drop_table("verification_calibrations")
    with op.batch_alter_table("verifications", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_verifications_project_id"))
        batch_op.drop_index(batch_op.f("ix_verifications_created_at"))
    op.drop_table("verifications")
