"""An optional name per replay run, shown in lists and page titles instead of the bare id.

`replay_runs.name` is free text (at most 200 characters, validated by the API); runs made before
0007 have none and keep showing their id. The downgrade drops the column (and the names).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("replay_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("name", sa.String(length=200), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # SQLite's own DROP COLUMN (3.35+): a batch copy of `replay_runs` would drop the old table,
        # and with foreign keys on, that deletes the rows that reference it (cascade).
        op.execute("ALTER TABLE replay_runs DROP COLUMN name")
        return
    op.drop_column("replay_runs", "name")
