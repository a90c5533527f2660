"""Due times of an audit schedule: a 5-field cron expression read in UTC.

Everything here takes and returns timezone-aware UTC datetimes and never looks at the machine's
time zone: croniter is handed UTC datetimes, and UTC has no daylight-saving transitions, so a
`0 2 * * *` schedule is due at 02:00 UTC every day whatever `TZ` says (RQ's own `cron=` reads its
expression in local time, which is why the production tick is registered by interval and the
due times are computed here).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Final

from croniter import CroniterBadCronError, CroniterBadDateError, croniter

from replay_audit.exceptions import FieldError

#: The default schedule: every night at 02:00 UTC.
NIGHTLY: Final = "0 2 * * *"
#: Longest cron expression accepted (characters).
MAX_CRON_LENGTH: Final = 100


def _utc(t: datetime) -> datetime:
    if t.tzinfo is None:
        raise ValueError("naive datetime; use an aware UTC datetime")
    return t.astimezone(UTC)


def _iter(expr: str, base: datetime) -> croniter:
    return croniter(expr, _utc(base))


def validate_cron(expr: str) -> str:
    """The expression, whitespace-normalised, or FieldError(field="cron") saying what is wrong.

    Five fields (minute hour day-of-month month day-of-week), read in UTC; croniter's syntax
    (lists, ranges, steps, names, `L` for the last day of the month). An expression that can
    never be due (`0 0 30 2 *`) is refused too.
    """
    fields = expr.split()
    if len(fields) != 5 or len(expr) > MAX_CRON_LENGTH:
        raise FieldError(
            "cron: give 5 fields (minute hour day-of-month month day-of-week), in UTC; "
            f"e.g. {NIGHTLY!r} for 02:00 UTC every night",
            field="cron",
        )
    normalised = " ".join(fields)
    try:
        if not croniter.is_valid(normalised):
            raise CroniterBadCronError(normalised)
        _iter(normalised, datetime(2000, 1, 1, tzinfo=UTC)).get_next(datetime)
    except CroniterBadCronError:
        raise FieldError(
            f"cron: {normalised!r} is not a valid cron expression", field="cron"
        ) from None
    except CroniterBadDateError:
        raise FieldError(f"cron: {normalised!r} is never due", field="cron") from None
    return normalised


def next_due(expr: str, after: datetime) -> datetime:
    """The first due time strictly after `after`."""
    t: datetime = _iter(expr, after).get_next(datetime)
    return t.astimezone(UTC)


def latest_due(expr: str, now: datetime) -> datetime:
    """The newest due time at or before `now`."""
    # Cron matches whole minutes: start from the next minute boundary, step back once.
    base = _utc(now).replace(second=0, microsecond=0) + timedelta(minutes=1)
    t: datetime = _iter(expr, base).get_prev(datetime)
    return t.astimezone(UTC)


def due_times(expr: str, start: datetime, end: datetime, *, limit: int = 1000) -> list[datetime]:
    """Every due time t with start <= t <= end, oldest first, at most `limit` of them (the
    newest `limit` when there are more: those are the ones a person still cares about)."""
    start, end = _utc(start), _utc(end)
    if end < start:
        return []
    out: list[datetime] = []
    # Walk backwards from the end so a limit keeps the newest.
    t = latest_due(expr, end)
    it = _iter(expr, t)
    while t >= start and len(out) < limit:
        out.append(t)
        t = it.get_prev(datetime).astimezone(UTC)
    out.reverse()
    return out
