"""Due times at frozen instants: UTC, month ends, 29 February, and the machine's time zone
(including daylight-saving changes) has no effect."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from itertools import pairwise

import pytest

from replay_audit.audits.models import AuditSchedule
from replay_audit.audits.schedule import NIGHTLY, due_times, latest_due, next_due, validate_cron
from replay_audit.audits.service import due_now
from replay_audit.exceptions import FieldError


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


@pytest.fixture
def local_tz() -> Iterator[None]:
    """Restore the process time zone after a test that changes it."""
    before = os.environ.get("TZ")
    yield
    if before is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = before
    time.tzset()


def test_nightly_latest_and_next() -> None:
    assert latest_due(NIGHTLY, utc(2026, 5, 10, 1, 59, 59)) == utc(2026, 5, 9, 2, 0)
    assert latest_due(NIGHTLY, utc(2026, 5, 10, 2, 0, 0)) == utc(2026, 5, 10, 2, 0)
    assert latest_due(NIGHTLY, utc(2026, 5, 10, 2, 0, 59, 999999)) == utc(2026, 5, 10, 2, 0)
    assert next_due(NIGHTLY, utc(2026, 5, 10, 2, 0)) == utc(2026, 5, 11, 2, 0)
    assert next_due(NIGHTLY, utc(2026, 5, 10, 1, 59)) == utc(2026, 5, 10, 2, 0)
    # The year turns over.
    assert next_due(NIGHTLY, utc(2026, 12, 31, 3, 0)) == utc(2027, 1, 1, 2, 0)


def test_results_are_utc_whatever_zone_the_input_carries() -> None:
    tokyo = timezone(timedelta(hours=9))
    # 10:30 in Tokyo is 01:30 UTC: the nightly 02:00 UTC run is still yesterday's.
    got = latest_due(NIGHTLY, datetime(2026, 5, 10, 10, 30, tzinfo=tokyo))
    assert got == utc(2026, 5, 9, 2, 0) and got.tzinfo == UTC


def test_naive_datetimes_are_refused() -> None:
    with pytest.raises(ValueError, match="naive"):
        latest_due(NIGHTLY, datetime(2026, 5, 10))


def test_month_ends() -> None:
    # Day 31 skips the months that have none.
    got = due_times("0 2 31 * *", utc(2026, 1, 1), utc(2026, 12, 31, 23))
    assert [d.month for d in got] == [1, 3, 5, 7, 8, 10, 12]
    # L: the last day of each month, whatever its length.
    ends = due_times("0 0 L * *", utc(2024, 1, 1), utc(2024, 12, 31, 23))
    assert [d.day for d in ends] == [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    assert next_due("0 0 L * *", utc(2025, 2, 1)) == utc(2025, 2, 28)
    # The first of the month after a month end, at midnight.
    assert next_due("0 0 1 * *", utc(2026, 4, 30, 23, 59)) == utc(2026, 5, 1)


def test_29_february() -> None:
    leap = "0 2 29 2 *"
    assert next_due(leap, utc(2025, 3, 1)) == utc(2028, 2, 29, 2)
    assert latest_due(leap, utc(2027, 6, 1)) == utc(2024, 2, 29, 2)
    assert latest_due(leap, utc(2028, 2, 29, 2, 0, 30)) == utc(2028, 2, 29, 2)
    # A nightly schedule has a run on 29 February of a leap year and none in other years.
    feb_2024 = due_times(NIGHTLY, utc(2024, 2, 1), utc(2024, 2, 29, 23))
    feb_2026 = due_times(NIGHTLY, utc(2026, 2, 1), utc(2026, 2, 28, 23))
    assert len(feb_2024) == 29 and feb_2024[-1] == utc(2024, 2, 29, 2)
    assert len(feb_2026) == 28


def test_due_times_bounds_and_limit() -> None:
    got = due_times(NIGHTLY, utc(2026, 5, 1, 2), utc(2026, 5, 3, 2))
    assert got == [utc(2026, 5, 1, 2), utc(2026, 5, 2, 2), utc(2026, 5, 3, 2)]  # inclusive
    assert due_times(NIGHTLY, utc(2026, 5, 3), utc(2026, 5, 1)) == []
    newest = due_times("* * * * *", utc(2026, 5, 1), utc(2026, 5, 2), limit=5)
    assert newest == [utc(2026, 5, 2) - timedelta(minutes=m) for m in (4, 3, 2, 1, 0)]


@pytest.mark.parametrize("zone", ["America/New_York", "Europe/Berlin", "Pacific/Chatham"])
def test_machine_time_zone_changes_nothing(zone: str, local_tz: None) -> None:
    """Across both 2026 daylight-saving changes of the zone, due times are those computed under
    UTC: 24 h apart, at 02:00 UTC (RQ's own cron would follow local time here)."""
    span = (utc(2026, 3, 1), utc(2026, 11, 30))
    os.environ["TZ"] = "UTC"
    time.tzset()
    expected = (
        due_times(NIGHTLY, *span),
        latest_due("30 1 * * *", utc(2026, 3, 29, 1, 45)),
        next_due("0 */6 * * *", utc(2026, 10, 25, 0, 30)),
    )
    os.environ["TZ"] = zone
    time.tzset()
    assert time.localtime(1_780_000_000).tm_gmtoff != 0  # the zone really is in effect
    got = (
        due_times(NIGHTLY, *span),
        latest_due("30 1 * * *", utc(2026, 3, 29, 1, 45)),
        next_due("0 */6 * * *", utc(2026, 10, 25, 0, 30)),
    )
    assert got == expected
    nightly = got[0]
    assert len(nightly) == 274
    assert all(d.hour == 2 and d.minute == 0 and d.tzinfo == UTC for d in nightly)
    assert all(b - a == timedelta(days=1) for a, b in pairwise(nightly))


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("", "5 fields"),
        ("0 2 * *", "5 fields"),
        ("0 0 2 * * *", "5 fields"),  # croniter would read a seconds field
        ("@daily", "5 fields"),
        ("61 2 * * *", "not a valid"),
        ("0 2 * * mon-xyz", "not a valid"),
        ("0 0 30 2 *", "never due"),
    ],
)
def test_invalid_cron(expr: str, message: str) -> None:
    with pytest.raises(FieldError, match=message) as e:
        validate_cron(expr)
    assert e.value.field == "cron"


def test_cron_is_normalised() -> None:
    assert validate_cron("  0   2 * *  1-5 ") == "0 2 * * 1-5"


def _schedule(**kw: object) -> AuditSchedule:
    values: dict[str, object] = {
        "cron": NIGHTLY,
        "status": "active",
        "active_since": utc(2026, 5, 1, 12),
    } | kw
    return AuditSchedule(**values)


def test_due_now_runs_only_the_newest_unclaimed_due_time() -> None:
    s = _schedule()
    # Created at noon: that morning's 02:00 was before it, so not due.
    assert due_now(s, None, utc(2026, 5, 1, 23)) is None
    assert due_now(s, None, utc(2026, 5, 2, 2, 0, 5)) == utc(2026, 5, 2, 2)
    assert due_now(s, utc(2026, 5, 2, 2), utc(2026, 5, 2, 2, 1)) is None  # already claimed
    # Down for three nights: only the newest is started; the others are "missed".
    assert due_now(s, utc(2026, 5, 2, 2), utc(2026, 5, 5, 9)) == utc(2026, 5, 5, 2)
    assert due_now(_schedule(status="paused"), None, utc(2026, 5, 5, 9)) is None
