"""What a scan-then-decode run did with each trace, as a column of replay_results.

`screen` is `flagged` (the scan found a disagreement; decoded from it), `control` (not flagged,
decoded in full: the control sample), `scanned` (only scanned: exact_match and category NULL), or
NULL in the other modes. The statistics read it for every result of a run (the miss rate, the
decoded/scanned split): a column, not a key of the detail JSON, which PostgreSQL cannot extract
from a document holding a `\\u0000` escape (a detokenised text may) and which is kilobytes a row.
Rows written before this revision have none: they are not screened results.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("replay_results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("screen", sa.String(length=16), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # SQLite's own DROP COLUMN (3.35+): a batch copy of `replay_results` would drop the
        # old table, and with foreign keys on, that deletes the rows that reference it.
        op.execute("ALTER TABLE replay_results DROP COLUMN screen")
        return
    op.drop_column("replay_results", "screen")
