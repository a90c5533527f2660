"""A replay job's queue names its route: `gpu:<kind>[:tp<k>]` (`queue.route`), up to 64
characters (a GPU kind is up to 48).

Downgrading sends each job of a per-kind or per-TP queue back to its device queue (`gpu`,
`cpu`), the only queues a release before this revision knows.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("replay_jobs", schema=None) as batch_op:
        batch_op.alter_column(
            "queue", existing_type=sa.String(length=32), type_=sa.String(length=64)
        )


def downgrade() -> None:
    for device in ("gpu", "cpu"):
        op.execute(
            sa.text("UPDATE replay_jobs SET queue = :device WHERE queue LIKE :routed").bindparams(
                device=device, routed=f"{device}:%"
            )
        )
    with op.batch_alter_table("replay_jobs", schema=None) as batch_op:
        batch_op.alter_column(
            "queue", existing_type=sa.String(length=64), type_=sa.String(length=32)
        )
