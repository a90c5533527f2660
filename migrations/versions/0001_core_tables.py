"""Core tables: projects, API keys, numerical configurations, traces, trace tags.

Revision ID: 0001
Revises:
Create Date: 2026-11-22

Static on purpose: only plain SQLAlchemy types, no imports from the package, so the migration
means the same thing forever. The packed arrays are LargeBinary (BLOB / bytea) holding
little-endian int32 token ids or float32 logits; timestamps are timezone-aware UTC.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 64-bit keys on PostgreSQL; SQLite autoincrements only an INTEGER PRIMARY KEY.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "projects",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_projects")),
        sa.UniqueConstraint("name", name=op.f("uq_projects_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("lookup", sa.String(length=32), nullable=False),
        sa.Column("key_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("revoked_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint(
            "role IN ('submitter', 'auditor', 'admin')", name=op.f("ck_api_keys_role")
        ),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
            name=op.f("fk_api_keys_project_id_projects"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("lookup", name=op.f("uq_api_keys_lookup")),
    )
    op.create_index(op.f("ix_api_keys_project_id"), "api_keys", ["project_id"])

    op.create_table(
        "numerical_configs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("public_id", sa.String(length=40), nullable=False),
        sa.Column("content_sha256", sa.String(length=64), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("lm_head_dtype", sa.String(length=16), nullable=False),
        sa.Column("attn_kernel", sa.String(length=64), nullable=False),
        sa.Column("device", sa.String(length=16), nullable=False),
        sa.Column("gpu_name", sa.String(length=200), nullable=True),
        sa.Column("gpu_sm", sa.String(length=8), nullable=True),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_numerical_configs")),
        sa.UniqueConstraint("content_sha256", name=op.f("uq_numerical_configs_content_sha256")),
        sa.UniqueConstraint("public_id", name=op.f("uq_numerical_configs_public_id")),
    )

    op.create_table(
        "traces",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("public_id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("config_id", sa.Integer(), nullable=False),
        sa.Column("model_name", sa.String(length=200), nullable=False),
        sa.Column("model_revision", sa.String(length=200), nullable=True),
        sa.Column("weights_sha256", sa.String(length=64), nullable=False),
        sa.Column("vocab_size", sa.Integer(), nullable=False),
        sa.Column("decoding", sa.JSON(), nullable=False),
        sa.Column("prompt_token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("output_token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("n_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("n_output_tokens", sa.Integer(), nullable=False),
        sa.Column("top_k", sa.Integer(), nullable=True),
        sa.Column("top_k_ids", sa.LargeBinary(), nullable=True),
        sa.Column("top_k_logits", sa.LargeBinary(), nullable=True),
        sa.Column("prompt_text", sa.Text(), nullable=True),
        sa.Column("output_text", sa.Text(), nullable=True),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("external_id", sa.String(length=200), nullable=True),
        sa.Column("reference_answer", sa.Text(), nullable=True),
        sa.Column("content_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["config_id"],
            ["numerical_configs.id"],
            name=op.f("fk_traces_config_id_numerical_configs"),
        ),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
            name=op.f("fk_traces_project_id_projects"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_traces")),
        # Idempotent ingest rests on these two.
        sa.UniqueConstraint(
            "project_id", "content_sha256", name=op.f("uq_traces_project_id_content_sha256")
        ),
        sa.UniqueConstraint(
            "project_id", "external_id", name=op.f("uq_traces_project_id_external_id")
        ),
        sa.UniqueConstraint("public_id", name=op.f("uq_traces_public_id")),
    )
    op.create_index(op.f("ix_traces_config_id"), "traces", ["config_id"])
    op.create_index(op.f("ix_traces_project_id_created_at"), "traces", ["project_id", "created_at"])
    op.create_index(op.f("ix_traces_project_id_model_name"), "traces", ["project_id", "model_name"])
    op.create_index(op.f("ix_traces_project_id_public_id"), "traces", ["project_id", "public_id"])
    op.create_index(
        op.f("ix_traces_project_id_weights_sha256"), "traces", ["project_id", "weights_sha256"]
    )

    op.create_table(
        "trace_tags",
        sa.Column("trace_id", BIG_ID, nullable=False),
        sa.Column("tag", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["trace_id"],
            ["traces.id"],
            name=op.f("fk_trace_tags_trace_id_traces"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("trace_id", "tag", name=op.f("pk_trace_tags")),
    )
    op.create_index(op.f("ix_trace_tags_tag_trace_id"), "trace_tags", ["tag", "trace_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_trace_tags_tag_trace_id"), table_name="trace_tags")
    op.drop_table("trace_tags")
    for name in (
        "ix_traces_project_id_weights_sha256",
        "ix_traces_project_id_public_id",
        "ix_traces_project_id_model_name",
        "ix_traces_project_id_created_at",
        "ix_traces_config_id",
    ):
        op.drop_index(op.f(name), table_name="traces")
    op.drop_table("traces")
    op.drop_table("numerical_configs")
    op.drop_index(op.f("ix_api_keys_project_id"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("projects")
