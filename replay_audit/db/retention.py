"""Retention: delete the traces older than a cutoff, with their tags, results and keys, and the
screenings older than the cutoff with their stored outputs.

    report = prune(database_url, timedelta(days=30), dry_run=True)   # what would go
    report = prune(database_url, timedelta(days=30))                 # remove it
    print(report.lines())

PostgreSQL (partitioned, see partition.py): every week that ends at or before the cutoff loses
its three partitions (DETACH + DROP, results and tags first), in one transaction, then the keys
of those traces (`trace_keys`). Retention is thus by whole weeks: a trace is kept between
`older_than` and `older_than` + 7 days. Rows that sit in the default partitions and are older
than the cutoff are deleted row by row, as on SQLite.

SQLite (and a PostgreSQL database without partitions): batches of `batch_size` traces, each
batch in its own transaction (SQLite has one writer: short transactions let the API write in
between), deleting results and tags before their traces and the keys with them. A result never
outlives its trace: the foreign keys say so, and the deletes run in that order.

Screenings (both databases): those created before the cutoff, in batches, each batch's
`screening_outputs` deleted before its `screenings` rows (SQLite does not cascade unless its
foreign keys are on). A screening still queued or running whose heartbeat (`updated_at`) is
newer than the cutoff is kept: a worker is writing its outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, cast

from sqlalchemy import CursorResult, TextClause, bindparam, text
from sqlalchemy.orm import Session

from replay_audit.db.base import utcnow
from replay_audit.db.partition import WeekPartitions, drop_week, droppable_weeks, is_partitioned
from replay_audit.db.unit_of_work import session_scope
from replay_audit.words import counted

#: Traces deleted per transaction where rows are deleted one by one.
BATCH_SIZE: Final = 1000


@dataclass
class PruneReport:
    """What `prune` removed (or, with `dry_run`, would remove)."""

    cutoff: datetime
    dry_run: bool
    #: Whole weeks of partitions dropped (PostgreSQL).
    weeks: list[WeekPartitions] = field(default_factory=list)
    #: Rows deleted one by one (SQLite; PostgreSQL's default partitions).
    traces_deleted: int = 0
    results_deleted: int = 0
    #: Keys of deleted traces (`trace_keys`); not counted in a dry run.
    keys_deleted: int = 0
    #: Screenings created before the cutoff, and their stored outputs (`screening_outputs`).
    screenings_deleted: int = 0
    screening_outputs_deleted: int = 0

    @property
    def traces_removed(self) -> int:
        return self.traces_deleted + sum(w.rows["traces"] for w in self.weeks)

    @property
    def results_removed(self) -> int:
        return self.results_deleted + sum(w.rows["replay_results"] for w in self.weeks)

    def lines(self) -> list[str]:
        """The report as printed by `replay-audit prune`."""
        verb = "would remove" if self.dry_run else "removed"
        out = [f"cutoff {self.cutoff.isoformat(timespec='seconds')}"]
        for w in self.weeks:
            size = sum(w.bytes.values()) / 2**20
            out.append(
                f"{verb} partitions of week {w.week:%Y-%m-%d}:"
                f" {counted(w.rows['traces'], 'trace')}, {counted(w.rows['trace_tags'], 'tag')},"
                f" {counted(w.rows['replay_results'], 'result')}, {size:.1f} MiB"
            )
        if self.traces_deleted or not self.weeks:
            out.append(
                f"{verb} {counted(self.traces_deleted, 'trace')} and"
                f" {counted(self.results_deleted, 'result')} row by row"
            )
        if not self.dry_run:
            out.append(f"removed {counted(self.keys_deleted, 'trace key')}")
        out.append(
            f"{verb} {counted(self.screenings_deleted, 'screening')}"
            f" ({counted(self.screening_outputs_deleted, 'stored output')})"
        )
        out.append(
            f"total: {verb} {counted(self.traces_removed, 'trace')},"
            f" {counted(self.results_removed, 'result')}"
        )
        return out


def prune(
    database_url: str,
    older_than: timedelta,
    *,
    now: datetime | None = None,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
) -> PruneReport:
    """Delete every trace created before `now - older_than` that retention can reach (see the
    module docstring), with its tags, results and key, and every screening created before it
    with its outputs; `dry_run` changes nothing and reports what would go. Owns its
    transactions (it is an edge: the CLI and the scheduler call it)."""
    cutoff = (now or utcnow()) - older_than
    report = PruneReport(cutoff=cutoff, dry_run=dry_run)
    _prune_screenings(database_url, cutoff, report, batch_size)
    with session_scope(database_url) as session:
        partitioned = is_partitioned(session)
        report.weeks = droppable_weeks(session, cutoff)
        if not dry_run and report.weeks:
            for week in report.weeks:
                drop_week(session, week.week)
            # Every trace before the last dropped week's end is gone (older weeks were
            # dropped with it, default-partition rows go below): so are their keys.
            end = max(w.end for w in report.weeks)
            deleted = session.execute(
                text("DELETE FROM trace_keys WHERE created_at < :end"), {"end": end}
            )
            report.keys_deleted += cast(CursorResult[Any], deleted).rowcount
    source = (
        "SELECT id, public_id FROM traces_default WHERE created_at < :cutoff"
        if partitioned
        # By the keys: their created_at is indexed (a scan of traces would read every row).
        else "SELECT t.id, t.public_id FROM trace_keys k JOIN traces t ON t.public_id ="
        " k.public_id WHERE k.created_at < :cutoff"
    )
    if dry_run:
        with session_scope(database_url) as session:
            rows = session.execute(text(source), {"cutoff": cutoff}).all()
            report.traces_deleted = len(rows)
            report.results_deleted = _count_in(
                session, "replay_results", "trace_id", [r[0] for r in rows]
            )
        return report
    while True:
        with session_scope(database_url) as session:
            rows = session.execute(
                text(f"{source} ORDER BY 1 LIMIT :n"), {"cutoff": cutoff, "n": batch_size}
            ).all()
            if not rows:
                break
            ids, public_ids = [r[0] for r in rows], [r[1] for r in rows]
            report.results_deleted += _delete_in(session, "replay_results", "trace_id", ids)
            _delete_in(session, "trace_tags", "trace_id", ids)
            report.keys_deleted += _delete_in(session, "trace_keys", "public_id", public_ids)
            report.traces_deleted += _delete_in(session, "traces", "id", ids)
    return report


#: Screenings retention may delete: created before the cutoff, and not being worked on.
_OLD_SCREENINGS: Final = (
    "SELECT id FROM screenings WHERE created_at < :cutoff"
    " AND NOT (status IN ('queued', 'running') AND updated_at >= :cutoff)"
)


def _prune_screenings(url: str, cutoff: datetime, report: PruneReport, batch_size: int) -> None:
    if report.dry_run:
        with session_scope(url) as session:
            ids = [r[0] for r in session.execute(text(_OLD_SCREENINGS), {"cutoff": cutoff})]
            report.screenings_deleted = len(ids)
            report.screening_outputs_deleted = _count_in(
                session, "screening_outputs", "screening_id", ids
            )
        return
    while True:
        with session_scope(url) as session:
            rows = session.execute(
                text(f"{_OLD_SCREENINGS} ORDER BY id LIMIT :n"), {"cutoff": cutoff, "n": batch_size}
            ).all()
            if not rows:
                return
            ids = [r[0] for r in rows]
            report.screening_outputs_deleted += _delete_in(
                session, "screening_outputs", "screening_id", ids
            )
            report.screenings_deleted += _delete_in(session, "screenings", "id", ids)


def _where_in(sql: str, column: str) -> TextClause:
    return text(f"{sql} WHERE {column} IN :values").bindparams(bindparam("values", expanding=True))


def _count_in(session: Session, table: str, column: str, values: list[int]) -> int:
    stmt = _where_in(f"SELECT count(*) FROM {table}", column)
    chunks = (values[start : start + BATCH_SIZE] for start in range(0, len(values), BATCH_SIZE))
    return sum(int(session.scalar(stmt, {"values": chunk}) or 0) for chunk in chunks)


def _delete_in(session: Session, table: str, column: str, values: list[object]) -> int:
    stmt = _where_in(f"DELETE FROM {table}", column)
    return int(cast(CursorResult[Any], session.execute(stmt, {"values": values})).rowcount)
