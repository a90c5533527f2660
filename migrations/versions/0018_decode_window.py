"""The decode window: `replay_runs.decode_window` (decodes compared with the logged tokens stop
this many tokens after t*; NULL: decoded to eos or the budget, as every run before this
revision) and `replay_results.window_cut` (the result's decode stopped at the window: its
replay output is a prefix of the whole continuation; NULL in rows written before, which were
decoded to the end).

Columns, not keys of the request or detail JSON: the statistics read `window_cut` of every
result (which figures a result may count), and the run's option is shown with its mode. Both
are added by each database's own ALTER TABLE ADD COLUMN (a batch copy of a table with foreign
keys pointing at it would delete their rows on SQLite) and dropped by its DROP COLUMN.

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("replay_runs", sa.Column("decode_window", sa.Integer(), nullable=True))
    op.add_column("replay_results", sa.Column("window_cut", sa.Boolean(), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # SQLite's own DROP COLUMN (3.35+): a batch copy would drop the old tables, and with
        # foreign keys on, that deletes the rows that reference them.
        op.execute("ALTER TABLE replay_results DROP COLUMN window_cut")
        op.execute("ALTER TABLE replay_runs DROP COLUMN decode_window")
        return
    op.drop_column("replay_results", "window_cut")
    op.drop_column("replay_runs", "decode_window")
