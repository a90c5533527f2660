"""Result columns named for arms (a, b), arm A's gate counts, and statistics stored anew.

`margin_logged*` held arm A's margin also in both-arms comparisons, where arm A is a target run
here, not the logged trace: the columns are renamed `margin_a*`, and `margin_replay*` becomes
`margin_b*`. Arm A's gate firings and steps (both-arms comparisons) become columns, backfilled
from the detail JSON, so statistics count both arms' gates. The stored run aggregate had another
shape than the statistics now stored (`stats.report.RunStatistics`): it is cleared, and a
finished run without stored statistics has them computed when read.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Rows backfilled per round trip.
BATCH = 1000
RENAMES = (
    ("margin_logged", "margin_a"),
    ("margin_logged_ulps", "margin_a_ulps"),
    ("margin_logged_source", "margin_a_source"),
    ("margin_replay", "margin_b"),
    ("margin_replay_ulps", "margin_b_ulps"),
)


def upgrade() -> None:
    with op.batch_alter_table("replay_results", schema=None) as batch_op:
        for old, new in RENAMES:
            batch_op.alter_column(old, new_column_name=new)
        batch_op.add_column(sa.Column("gate_triggers_a", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("n_steps_a", sa.Integer(), nullable=True))

    results = sa.table(
        "replay_results",
        sa.column("id", sa.BigInteger()),
        sa.column("output_a", sa.LargeBinary()),
        sa.column("detail", sa.JSON()),
        sa.column("gate_triggers_a", sa.Integer()),
        sa.column("n_steps_a", sa.Integer()),
    )
    bind = op.get_bind()
    last = -1
    while True:
        rows = bind.execute(
            sa.select(results.c.id, results.c.detail)
            .where(results.c.id > last, results.c.output_a.is_not(None))
            .order_by(results.c.id)
            .limit(BATCH)
        ).all()
        if not rows:
            break
        for row_id, detail in rows:
            d = json.loads(detail) if isinstance(detail, str | bytes) else (detail or {})
            arm = d.get("logged_arm") or {}
            if arm.get("steps") is not None:
                bind.execute(
                    sa.update(results)
                    .where(results.c.id == row_id)
                    .values(gate_triggers_a=arm.get("gate_triggers"), n_steps_a=arm["steps"])
                )
        last = rows[-1][0]
    runs = sa.table("replay_runs", sa.column("aggregate", sa.JSON()))
    bind.execute(sa.update(runs).values(aggregate=sa.null()))


def downgrade() -> None:
    with op.batch_alter_table("replay_results", schema=None) as batch_op:
        batch_op.drop_column("n_steps_a")
        batch_op.drop_column("gate_triggers_a")
        for old, new in RENAMES:
            batch_op.alter_column(new, new_column_name=old)
