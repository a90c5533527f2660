"""Extracted answers as columns of replay_results, backfilled from the detail JSON.

Task accuracy over a large run read every result's detail JSON (about 4 KB with the margin
track) to find two short strings; columns make it a few bytes per row.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Rows backfilled per round trip.
BATCH = 1000


def upgrade() -> None:
    with op.batch_alter_table("replay_results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("answer_extractor", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("answer_a", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("answer_b", sa.Text(), nullable=True))

    results = sa.table(
        "replay_results",
        sa.column("id", sa.BigInteger()),
        sa.column("semantic_agree", sa.Boolean()),
        sa.column("detail", sa.JSON()),
        sa.column("answer_extractor", sa.String()),
        sa.column("answer_a", sa.Text()),
        sa.column("answer_b", sa.Text()),
    )
    bind = op.get_bind()
    last = -1
    while True:
        rows = bind.execute(
            sa.select(results.c.id, results.c.detail)
            .where(results.c.id > last, results.c.semantic_agree.is_not(None))
            .order_by(results.c.id)
            .limit(BATCH)
        ).all()
        if not rows:
            return
        for row_id, detail in rows:
            d = json.loads(detail) if isinstance(detail, str | bytes) else (detail or {})
            sem = d.get("semantic") or {}
            if sem.get("extractor"):
                bind.execute(
                    sa.update(results)
                    .where(results.c.id == row_id)
                    .values(
                        answer_extractor=sem["extractor"],
                        answer_a=sem.get("logged_answer"),
                        answer_b=sem.get("replay_answer"),
                    )
                )
        last = rows[-1][0]


def downgrade() -> None:
    with op.batch_alter_table("replay_results", schema=None) as batch_op:
        batch_op.drop_column("answer_b")
        batch_op.drop_column("answer_a")
        batch_op.drop_column("answer_extractor")
