"""Weekly range partitions of the trace tables on PostgreSQL (migration 0010 made them).

    created = ensure_partitions(session, now)        # this week and WEEKS_AHEAD more
    weeks = droppable_weeks(session, cutoff)          # whole weeks older than a cutoff
    drop_week(session, week)                          # DETACH + DROP its three partitions

`traces` is partitioned by `created_at`, `trace_tags` and `replay_results` by their trace's
`created_at`, so one week's trace, tags and results are three partitions named after the
week's Monday (`traces_p20261116`, `trace_tags_p20261116`, `replay_results_p20261116`) that are
created together and dropped together. Each table also has a default partition (`T_default`):
an insert never fails for want of a partition, and `ensure_partitions` moves the rows a new
week's range finds there into the new partitions.

Why weeks. At a million traces a night (about 8 GB of token arrays a night) a week is ~56 GB.
Monthly partitions (~240 GB) would make retention coarse: with 30 days kept, up to 60 days sit
on disk. Daily ones would multiply the partitions every query not narrowed by time visits
(lookups by public id probe each partition's index): ~90 for a 90-day retention instead of ~14.
A week keeps at most 7 days more than asked for.

SQLite has no partitions: everything here answers "nothing to do" there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from sqlalchemy import text
from sqlalchemy.orm import Session

#: Weeks created ahead of the current one (the scheduler keeps them there).
WEEKS_AHEAD: Final = 4
WEEK: Final = timedelta(weeks=1)
#: The partitioned tables and their partition keys: a table that references another comes
#: before it (the order partitions are emptied and dropped in; created in the reverse).
PARTITIONED_TABLES: Final = (
    ("replay_results", "trace_created_at"),
    ("trace_tags", "trace_created_at"),
    ("traces", "created_at"),
)
_WEEK_PARTITION = re.compile(r"^traces_p(\d{8})$")
#: pg_advisory_xact_lock key: one partition maintainer at a time (several API processes,
#: `rq cron` and the CLI may all try).
_LOCK_KEY: Final = 0x7265706C6179  # "replay"


def week_start(t: datetime) -> datetime:
    """Monday 00:00 UTC of the week holding `t`."""
    t = t.astimezone(UTC)
    return (t - timedelta(days=t.weekday())).replace(hour=0, minute=0, second=0, microsecond=0)


def partition_name(table: str, week: datetime) -> str:
    return f"{table}_p{week:%Y%m%d}"


def is_partitioned(session: Session) -> bool:
    """True on a PostgreSQL database whose `traces` is partitioned (at revision 0010 or
    later); False on SQLite."""
    if session.get_bind().dialect.name != "postgresql":
        return False
    kind = session.scalar(text("SELECT relkind FROM pg_class WHERE oid = to_regclass('traces')"))
    return bool(kind == "p")


def weeks(session: Session) -> list[datetime]:
    """The weeks that have partitions, oldest first (none on SQLite)."""
    if not is_partitioned(session):
        return []
    rows = session.scalars(
        text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = to_regclass('traces')"
        )
    )
    matches = [m for m in map(_WEEK_PARTITION.match, rows) if m]
    return sorted(datetime.strptime(m.group(1), "%Y%m%d").replace(tzinfo=UTC) for m in matches)


def _lock(session: Session) -> None:
    session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})


def _literal(t: datetime) -> str:
    return f"'{t.isoformat()}'"  # our own datetimes, never user input


def ensure_partitions(session: Session, now: datetime, weeks_ahead: int = WEEKS_AHEAD) -> list[str]:
    """Create the partitions of the current week and `weeks_ahead` more that do not exist yet
    (moving rows of their ranges out of the default partitions first); the names created.
    Nothing on SQLite. Never commits."""
    if not is_partitioned(session):
        return []
    _lock(session)
    have = set(weeks(session))
    first = week_start(now)
    created: list[str] = []
    for week in (first + i * WEEK for i in range(weeks_ahead + 1)):
        if week not in have:
            created += _create_week(session, week)
    return created


def _create_week(session: Session, week: datetime) -> list[str]:
    start, end = _literal(week), _literal(week + WEEK)
    names = {table: partition_name(table, week) for table, _ in PARTITIONED_TABLES}
    for table, _ in PARTITIONED_TABLES:
        session.execute(
            text(
                f"CREATE TABLE {names[table]}"
                f" (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
            )
        )
    # Rows already in a default partition for this week (written before the week existed)
    # move over, references first: the unattached tables have no foreign keys yet, so taking
    # a trace out of traces_default cascades to nothing.
    for table, key in PARTITIONED_TABLES:
        session.execute(
            text(
                f"WITH moved AS (DELETE FROM {table}_default"
                f" WHERE {key} >= {start} AND {key} < {end} RETURNING *)"
                f" INSERT INTO {names[table]} SELECT * FROM moved"
            )
        )
    for table, _ in reversed(PARTITIONED_TABLES):  # the referenced table first
        session.execute(
            text(
                f"ALTER TABLE {table} ATTACH PARTITION {names[table]}"
                f" FOR VALUES FROM ({start}) TO ({end})"
            )
        )
    return [names[table] for table, _ in reversed(PARTITIONED_TABLES)]


@dataclass(frozen=True)
class WeekPartitions:
    """One week's partitions: rows and bytes (table, indexes and TOAST) per table."""

    week: datetime
    rows: dict[str, int]
    bytes: dict[str, int]

    @property
    def end(self) -> datetime:
        return self.week + WEEK


def droppable_weeks(session: Session, cutoff: datetime) -> list[WeekPartitions]:
    """The weeks whose partitions hold only rows older than `cutoff` (the week ends at or
    before it), with their sizes; none on SQLite."""
    if not is_partitioned(session):
        return []
    found = []
    for week in weeks(session):
        if week + WEEK > cutoff:
            continue
        rows, sizes = {}, {}
        for table, _ in PARTITIONED_TABLES:
            name = partition_name(table, week)
            rows[table] = int(session.scalar(text(f"SELECT count(*) FROM {name}")) or 0)
            sizes[table] = int(
                session.scalar(text("SELECT pg_total_relation_size(to_regclass(:n))"), {"n": name})
                or 0
            )
        found.append(WeekPartitions(week, rows, sizes))
    return found


def drop_week(session: Session, week: datetime) -> None:
    """DETACH and DROP the week's three partitions, results and tags before their traces
    (PostgreSQL refuses to detach traces that rows elsewhere still reference). Never commits."""
    _lock(session)
    for table, _ in PARTITIONED_TABLES:
        name = partition_name(table, week)
        session.execute(text(f"ALTER TABLE {table} DETACH PARTITION {name}"))
        session.execute(text(f"DROP TABLE {name}"))
