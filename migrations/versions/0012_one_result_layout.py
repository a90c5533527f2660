"""One result layout for 0.x, and the resolved arms as columns.

Results written by earlier 0.x releases kept some of their detail JSON in older layouts (arm B's
values at the top level with `logged_arm` beside them; `single_step.logged/replay`; semantic
answers named `logged_answer`/`replay_answer`; and later rows repeated those names beside the
new ones). This revision rewrites every such row into the one layout the code reads
(`replays/results.py`: `arms.a`/`arms.b`, `single_step.a/b`, `semantic.answer_a/b`), so no reader
of an older layout is left in the code.

`resolved_a`/`resolved_b` hold each arm's resolved computation (`domain.ResolvedArm` as JSON:
formats, the attention kernel that ran and why, batch, TP, device and GPU, engine path,
intervention), NULL for the logged tokens and for rows written before this revision (not
recorded). Columns, not detail JSON: the run page counts what ran per comparison with a GROUP BY,
which PostgreSQL cannot do over a JSON document holding a `\\u0000` escape.

The statistics stored with finished runs (`replay_runs.aggregate`) are cleared: they were
written with the names of earlier releases beside the current ones, and `replay-audit db
upgrade` (and `serve`) store every finished run's statistics again from its rows, in the one
layout (`replays/statistics.store_missing`).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Rows rewritten per round trip.
BATCH = 1000

_LEGACY_TOP = (
    "target",
    "environment",
    "logged_environment",
    "changed_steps",
    "margins",
    "gate_fired_steps",
    "replay_text",
    "logged_arm",
    "replay_output_token_ids",
    "arm_a_output_token_ids",
)


def _arms(detail: dict[str, Any]) -> dict[str, Any]:
    logged = detail.get("logged_arm") or {}
    keys = ("target", "gate_triggers", "steps", "mean_gap", "changed_steps", "margins")
    a = {k: logged.get(k) for k in keys}
    a |= {
        "gate_fired_steps": logged.get("gate_fired_steps"),
        "environment": detail.get("logged_environment"),
        "text": logged.get("text"),
    }
    b = {k: detail.get(k) for k in ("target", "changed_steps", "margins", "gate_fired_steps")}
    b |= {
        "gate_triggers": None,
        "steps": None,
        "mean_gap": None,
        "environment": detail.get("environment"),
        "text": detail.get("replay_text"),
    }
    return {"a": a, "b": b}


def one_layout(detail: dict[str, Any]) -> dict[str, Any]:
    """A result's detail JSON in the one layout (unchanged where it already is)."""
    if not detail:
        return detail
    out = dict(detail)
    if "arms" not in out:
        out["arms"] = _arms(out)
    for key in _LEGACY_TOP:
        out.pop(key, None)
    single = out.get("single_step")
    if isinstance(single, dict):
        a = single.get("a", single.get("logged"))
        b = single.get("b", single.get("replay"))
        out["single_step"] = {
            "step": single.get("step"),
            "a": a,
            "b": b,
            "disagree": single.get("disagree"),
        }
    sem = out.get("semantic")
    if isinstance(sem, dict):
        answer_a = sem.get("answer_a", sem.get("logged_answer"))
        answer_b = sem.get("answer_b", sem.get("replay_answer"))
        correct_a = sem.get("correct_a", sem.get("logged_correct"))
        correct_b = sem.get("correct_b", sem.get("replay_correct"))
        neither = answer_a is None and answer_b is None
        out["semantic"] = {
            "extractor": sem.get("extractor"),
            "answer_a": answer_a,
            "answer_b": answer_b,
            "agree": None if neither else answer_a == answer_b,
            "neither_answered": neither,
            "correct_a": correct_a,
            "correct_b": correct_b,
        }
    return out


def upgrade() -> None:
    with op.batch_alter_table("replay_results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("resolved_a", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("resolved_b", sa.Text(), nullable=True))
    conn = op.get_bind()
    runs = sa.table("replay_runs", sa.column("aggregate", sa.JSON))
    conn.execute(runs.update().values(aggregate=sa.null()))
    results = sa.table(
        "replay_results",
        sa.column("id", sa.BigInteger),
        sa.column("detail", sa.JSON),
    )
    after = 0
    while True:
        rows = conn.execute(
            sa.select(results.c.id, results.c.detail)
            .where(results.c.id > after)
            .order_by(results.c.id)
            .limit(BATCH)
        ).all()
        if not rows:
            break
        after = rows[-1].id
        for row in rows:
            detail = row.detail if isinstance(row.detail, dict) else json.loads(row.detail or "{}")
            converted = one_layout(detail)
            if converted != detail:
                # By id alone (unique: one sequence across partitions; the key's index leads
                # with it): a datetime read back and bound again may not compare equal on SQLite.
                conn.execute(
                    results.update().where(results.c.id == row.id).values(detail=converted)
                )


def downgrade() -> None:
    # The converted rows stay in the one layout: the previous release reads it as well.
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE replay_results DROP COLUMN resolved_b")
        op.execute("ALTER TABLE replay_results DROP COLUMN resolved_a")
        return
    op.drop_column("replay_results", "resolved_b")
    op.drop_column("replay_results", "resolved_a")
