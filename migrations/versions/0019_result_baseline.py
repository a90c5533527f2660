"""Reproduce before comparing: `replay_results.baseline`, what a comparison with the logged
tokens was judged against ("logged"; "reproduced" where the trace did not reproduce in its own
logged configuration and arm A is that replay; "replayed" for a trace of an engine this
service cannot run). NULL in rows written before this revision, which were all judged against
the logged tokens ("logged").

A column, not a key of the detail JSON: the statistics count every result by it. Added by each
database's own ALTER TABLE ADD COLUMN (a batch copy of a table with foreign keys pointing at it
would delete their rows on SQLite) and dropped by its DROP COLUMN.

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | Sequence[str] | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("replay_results", sa.Column("baseline", sa.String(16), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE replay_results DROP COLUMN baseline")
        return
    op.drop_column("replay_results", "baseline")
