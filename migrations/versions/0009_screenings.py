"""Screenings (`POST /v1/screenings`) and the outputs a screening job resumes from.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "screenings",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("public_id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("model_sha256", sa.String(length=64), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("report", sa.JSON(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=True),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'done', 'failed')", name=op.f("ck_screenings_status")
        ),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
            name=op.f("fk_screenings_project_id_projects"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_screenings")),
        sa.UniqueConstraint(
            "project_id", "idempotency_key", name=op.f("uq_screenings_project_id_idempotency_key")
        ),
        sa.UniqueConstraint("public_id", name=op.f("uq_screenings_public_id")),
    )
    with op.batch_alter_table("screenings", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_screenings_created_at"), ["created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_screenings_project_id"), ["project_id"], unique=False)

    op.create_table(
        "screening_outputs",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("screening_id", BIG_ID, nullable=False),
        sa.Column("key", sa.String(length=300), nullable=False),
        sa.Column("value", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["screening_id"],
            ["screenings.id"],
            name=op.f("fk_screening_outputs_screening_id_screenings"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_screening_outputs")),
        sa.UniqueConstraint(
            "screening_id", "key", name=op.f("uq_screening_outputs_screening_id_key")
        ),
    )
    with op.batch_alter_table("screening_outputs", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_screening_outputs_screening_id"), ["screening_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("screening_outputs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_screening_outputs_screening_id"))
    op.drop_table("screening_outputs")
    with op.batch_alter_table("screenings", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_screenings_project_id"))
        batch_op.drop_index(batch_op.f("ix_screenings_created_at"))
    op.drop_table("screenings")
