"""A job's lease on its row: `screenings.lease_until` and `verifications.lease_until`, renewed
by the job while it runs and cleared when it ends. A second start of the job while the lease
lives backs off (a Redis restart lost the queued job and the reconciler enqueued it again while
the first still ran); a killed worker's lease lapses on its own. NULL: no job holds the row.

Added by each database's own ALTER TABLE ADD COLUMN and dropped by its DROP COLUMN (a batch copy
of a table with foreign keys pointing at it would delete their rows on SQLite).

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | Sequence[str] | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("screenings", "verifications")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    for table in TABLES:
        if op.get_bind().dialect.name == "sqlite":
            op.execute(f"ALTER TABLE {table} DROP COLUMN lease_until")
        else:
            op.drop_column(table, "lease_until")
