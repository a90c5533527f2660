"""Audit schedules that verify their samples: `audit_schedules.verify` (the verification's
options, NULL: the schedule does not verify) and `audit_runs.verification_id` (the run's
verification, an ordinary `verifications` row; SET NULL if it is deleted).

On SQLite the column is added by SQLite's own ALTER TABLE ADD COLUMN, and its foreign key
(named, as the models name it) written into the stored CREATE statement: a batch copy of
`audit_runs` would drop the table, and with foreign keys on that deletes its alerts (ON DELETE
CASCADE). Every row's new column is NULL, so the constraint holds and nothing on disk changes,
as 0014 edits a NOT NULL. The downgrade takes the constraint out again so that SQLite's DROP
COLUMN accepts the column.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
FK = "fk_audit_runs_verification_id_verifications"
INDEX = "ix_audit_runs_verification_id"
#: The table constraint written into `audit_runs`' stored CREATE statement on SQLite.
SQLITE_FK = (
    f", CONSTRAINT {FK} FOREIGN KEY(verification_id) REFERENCES verifications (id)"
    " ON DELETE SET NULL"
)


def _edit_sqlite_schema(sql_expression: str) -> None:
    """Set `audit_runs`' stored CREATE statement to `sql_expression` (of the old one, `sql`)."""
    bind = op.get_bind()
    version = bind.execute(sa.text("PRAGMA schema_version")).scalar_one()
    op.execute("PRAGMA writable_schema = ON")
    op.execute(
        f"UPDATE sqlite_master SET sql = {sql_expression}"
        " WHERE type = 'table' AND name = 'audit_runs'"
    )
    op.execute(f"PRAGMA schema_version = {version + 1}")
    op.execute("PRAGMA writable_schema = OFF")


def upgrade() -> None:
    with op.batch_alter_table("audit_schedules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("verify", sa.JSON(), nullable=True))
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE audit_runs ADD COLUMN verification_id INTEGER")
        # The statement ends with its closing parenthesis: the constraint goes before it.
        _edit_sqlite_schema(f"substr(rtrim(sql), 1, length(rtrim(sql)) - 1) || '{SQLITE_FK})'")
    else:
        op.add_column("audit_runs", sa.Column("verification_id", BIG_ID, nullable=True))
        op.create_foreign_key(
            op.f(FK), "audit_runs", "verifications", ["verification_id"], ["id"],
            ondelete="SET NULL",
        )  # fmt: skip
    op.create_index(op.f(INDEX), "audit_runs", ["verification_id"], unique=False)


def downgrade() -> None:
    bind = op.get_bind()
    op.drop_index(op.f(INDEX), table_name="audit_runs")
    if bind.dialect.name == "sqlite":
        _edit_sqlite_schema(f"replace(sql, '{SQLITE_FK}', '')")
        op.execute("ALTER TABLE audit_runs DROP COLUMN verification_id")
        op.execute("ALTER TABLE audit_schedules DROP COLUMN verify")
        return
    op.drop_constraint(op.f(FK), "audit_runs", type_="foreignkey")
    op.drop_column("audit_runs", "verification_id")
    op.drop_column("audit_schedules", "verify")
