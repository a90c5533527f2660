"""Each logged output token's piece (its text, or its bytes), stored with the trace.

Token ids alone mean nothing to an auditor, and the API process loads no tokenizer: whoever has
one (`generate`, an importer whose source gives token strings, a client posting
`output_token_pieces`) stores the pieces (`replay_audit.diff.pieces` stored form, a JSON array).
Traces stored before have none (null): their pages show ids, or the pieces a replay worker
stored with its result. Replayed arms' pieces live in the result's detail JSON (no column).

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("traces", schema=None) as batch_op:
        batch_op.add_column(sa.Column("output_token_pieces", sa.JSON(), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # SQLite's own DROP COLUMN (3.35+): a batch copy of `traces` would drop the old table,
        # and with foreign keys on, that deletes every tag and result of its traces (cascade).
        op.execute("ALTER TABLE traces DROP COLUMN output_token_pieces")
        return
    op.drop_column("traces", "output_token_pieces")
