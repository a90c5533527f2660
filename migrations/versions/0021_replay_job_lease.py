"""A replay job's lease on its row: `replay_jobs.lease_until`, as 0020 gave screenings and
verifications. Taken when the job claims an attempt, renewed while it runs and cleared when it
ends (`db.job_row.leased`): a second start of the job while the lease lives backs off (Redis
restarted and the reconciler enqueued it again, or RQ delivered it twice), and the reconciler
leaves a leased job alone. NULL: no job holds the row.

Added by each database's own ALTER TABLE ADD COLUMN and dropped by its DROP COLUMN (a batch copy
of a table on SQLite would be needless for one nullable column).

Revision ID: 0021
Revises: 0020
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | Sequence[str] | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "replay_jobs", sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE replay_jobs DROP COLUMN lease_until")
    else:
        op.drop_column("replay_jobs", "lease_until")
