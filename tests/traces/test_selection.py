"""TraceSelection, the one value every trace selection is made of (pure), and `is_greedy`."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta, timezone

import pytest

from replay_audit.traces.selection import TraceSelection, is_greedy


def test_a_time_without_a_zone_means_utc() -> None:
    paris = timezone(timedelta(hours=1))
    naive, aware = datetime(2030, 1, 15, 2), datetime(2030, 1, 15, 3, tzinfo=paris)
    s = TraceSelection(created_after=naive, created_before=aware)
    assert s.created_after == datetime(2030, 1, 15, 2, tzinfo=UTC)
    assert s.created_before is not None and s.created_before.utcoffset() == timedelta(hours=1)


def test_tags_are_a_set_in_the_order_given_and_the_value_is_frozen() -> None:
    s = TraceSelection(tags=("b", "a", "b"))
    assert s.tags == ("b", "a")
    assert s == TraceSelection(tags=("b", "a"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.greedy = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("decoding", "greedy"),
    [
        ({"strategy": "greedy"}, True),
        ({}, True),  # the schema's default
        ({"strategy": None}, True),
        ({"strategy": "sample"}, False),
        ({"strategy": "beam"}, False),
    ],
)
def test_is_greedy(decoding: dict[str, object], greedy: bool) -> None:
    assert is_greedy(decoding) is greedy
