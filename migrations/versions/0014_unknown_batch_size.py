"""A configuration's batch size may be unknown (NULL); a trace keeps its chat messages.

An imported trace whose source does not state the batch size (one logged response) used to be
stored with batch size 1, which read as a fact. The column now takes NULL for "not known".
Downgrading writes 1 into the unknown rows again, as before this revision.

`traces.prompt_messages` (JSON, NULL for a plain text prompt): the messages of a chat prompt, whose
ids are their rendering by the checkpoint's chat template (`generate` on `{"messages": [...]}`
lines, imported chat requests). Downgrading drops them.

Revision ID: 0014
Revises: 0012
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _nullable_batch_size(nullable: bool) -> None:
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        op.alter_column("numerical_configs", "batch_size", nullable=nullable)
        return
    # SQLite alters no column, and a rebuild (batch mode) would drop a table that `traces`
    # refers to. Dropping or adding a NOT NULL the rows satisfy changes nothing on disk: the
    # stored CREATE statement is edited, as SQLite's ALTER TABLE documentation describes.
    strict, lax = "batch_size INTEGER NOT NULL,", "batch_size INTEGER,"
    old, new = (strict, lax) if nullable else (lax, strict)
    version = bind.execute(sa.text("PRAGMA schema_version")).scalar_one()
    op.execute("PRAGMA writable_schema = ON")
    op.execute(
        f"UPDATE sqlite_master SET sql = replace(sql, '{old}', '{new}')"
        " WHERE type = 'table' AND name = 'numerical_configs'"
    )
    op.execute(f"PRAGMA schema_version = {version + 1}")
    op.execute("PRAGMA writable_schema = OFF")


def upgrade() -> None:
    _nullable_batch_size(True)
    with op.batch_alter_table("traces", schema=None) as batch_op:
        batch_op.add_column(sa.Column("prompt_messages", sa.JSON(), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # As 0008: SQLite's own DROP COLUMN, never a batch copy of `traces` (its cascades).
        op.execute("ALTER TABLE traces DROP COLUMN prompt_messages")
    else:
        op.drop_column("traces", "prompt_messages")
    op.execute("UPDATE numerical_configs SET batch_size = 1 WHERE batch_size IS NULL")
    _nullable_batch_size(False)
