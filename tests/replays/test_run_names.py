"""Run names and the runs list: `name` on `POST /v1/replays` (bounded, one line, storable),
read back by `GET /v1/replays/{id}` and `GET /v1/replays` (newest first, cursor-paged, filtered,
one project's runs, readers only), shown by the UI instead of the bare id; audit runs are named
after their schedule and due time. SQLite and PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.audits.service import run_name
from replay_audit.replays.models import MAX_RUN_NAME
from tests.audits.conftest import schedule_body
from tests.replays.conftest import HoldingRunner, ingest
from tests.reports.conftest import runner  # noqa: F401  (fixture)


@pytest.fixture
def trace_ids(
    client: TestClient,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> list[str]:
    return ingest(client, headers("admin"), [logged_trace([1, 2, 3]), logged_trace([4, 5, 6])])


def _create(client: TestClient, key: dict[str, str], ids: list[str], **extra: Any) -> Any:
    body = {"trace_ids": ids, "targets": [{"dtype": "fp16"}], **extra}
    return client.post("/v1/replays", json=body, headers=key)


def test_a_name_is_stored_read_and_listed(
    client: TestClient,
    runner: HoldingRunner,  # noqa: F811
    headers: Callable[..., dict[str, str]],
    trace_ids: list[str],
) -> None:
    admin = headers("admin")
    named = _create(client, admin, trace_ids, name="  fp16 screen, week 47  ")
    assert named.status_code == 201, named.text
    plain = _create(client, admin, trace_ids[:1])
    run_id, plain_id = named.json()["id"], plain.json()["id"]

    read = client.get(f"/v1/replays/{run_id}", headers=headers("auditor")).json()
    assert read["name"] == "fp16 screen, week 47"  # blanks around it stripped
    assert read["request"]["name"] == "fp16 screen, week 47"
    assert client.get(f"/v1/replays/{plain_id}", headers=admin).json()["name"] is None
    # A submitter polling its run's status sees its name too.
    status = client.get(f"/v1/replays/{run_id}", headers=headers("submitter")).json()
    assert status["name"] == "fp16 screen, week 47"

    listed = client.get("/v1/replays", headers=headers("auditor"))
    assert listed.status_code == 200, listed.text
    items = listed.json()["items"]
    assert [(i["id"], i["name"]) for i in items] == [
        (plain_id, None),
        (run_id, "fp16 screen, week 47"),
    ]
    assert items[1]["n_traces"] == 2 and items[1]["targets"] == ["fp16", "self: reproduction check"]
    assert items[1]["models"] == []  # read from its results: none before it runs
    assert listed.json()["next_cursor"] is None


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("x" * (MAX_RUN_NAME + 1), "at most"),
        ("", "at least"),
        ("   ", "blank"),
        ("line one\nline two", "control characters"),
        ("tab\there", "control characters"),
        ("nul\x00", "U+0000"),
        (42, "string"),
    ],
)
def test_a_bad_name_is_a_422_naming_it(
    client: TestClient,
    runner: HoldingRunner,  # noqa: F811
    headers: Callable[..., dict[str, str]],
    trace_ids: list[str],
    name: Any,
    why: str,
) -> None:
    r = _create(client, headers("admin"), trace_ids, name=name)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "name", r.text
    assert why in r.text
    assert client.get("/v1/replays", headers=headers("admin")).json()["items"] == []


def test_the_longest_name_is_stored_whole(
    client: TestClient,
    runner: HoldingRunner,  # noqa: F811
    headers: Callable[..., dict[str, str]],
    trace_ids: list[str],
) -> None:
    name = "é" * MAX_RUN_NAME  # characters, not bytes
    r = _create(client, headers("admin"), trace_ids, name=name)
    assert r.status_code == 201, r.text
    assert (
        client.get(f"/v1/replays/{r.json()['id']}", headers=headers("admin")).json()["name"] == name
    )


def test_the_runs_list_pages_filters_and_isolates(
    client: TestClient,
    runner: HoldingRunner,  # noqa: F811
    headers: Callable[..., dict[str, str]],
    trace_ids: list[str],
) -> None:
    admin = headers("admin")
    made = [_create(client, admin, trace_ids, name=f"run {i}").json()["id"] for i in range(5)]
    bf16 = _create(client, admin, trace_ids, targets=[{"dtype": "bf16"}]).json()["id"]
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/replays", params=params, headers=admin).json()
        assert len(page["items"]) <= 2
        seen += [i["id"] for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [bf16, *reversed(made)]  # newest first, each once

    def named(text: str) -> list[str]:
        page = client.get("/v1/replays", params={"name": text}, headers=admin).json()
        return [i["id"] for i in page["items"]]

    assert named("RUN 3") == [made[3]]  # a substring, any case
    assert named("run") == list(reversed(made))  # the unnamed run has no name to match
    assert named("%") == [] and named("run_") == []  # literal, not LIKE patterns
    by_dtype = client.get("/v1/replays", params={"dtype": "bf16"}, headers=admin).json()
    assert [i["id"] for i in by_dtype["items"]] == [bf16]
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    after = client.get("/v1/replays", params={"created_after": later}, headers=admin).json()
    assert after["items"] == []

    assert client.get("/v1/replays", headers=headers("admin", "beta")).json()["items"] == []
    assert client.get("/v1/replays", headers=headers("submitter")).status_code == 403
    for bad, field in (({"cursor": "nope"}, "cursor"), ({"limit": 0}, "limit")):
        r = client.get("/v1/replays", params=bad, headers=admin)
        assert r.status_code == 422 and r.json()["field"] == field, r.text


def test_audit_runs_are_named_after_schedule_and_due_time() -> None:
    due = datetime(2026, 11, 22, 2, 30, tzinfo=UTC)
    assert run_name("nightly fp16", due) == "nightly fp16 2026-11-22 02:30 UTC"
    long = run_name("n" * 300, due)
    assert len(long) == MAX_RUN_NAME and long.endswith(" 2026-11-22 02:30 UTC")
    assert run_name("two\nlines", due) == "two lines 2026-11-22 02:30 UTC"


def test_an_audit_names_its_run(
    client: TestClient,
    runner: HoldingRunner,  # noqa: F811
    headers: Callable[..., dict[str, str]],
    trace_ids: list[str],
) -> None:
    admin = headers("admin")
    r = client.post("/v1/audits/schedules", json=schedule_body(), headers=admin)
    assert r.status_code == 201, r.text
    r = client.post(f"/v1/audits/schedules/{r.json()['id']}/runs", headers=admin)
    assert r.status_code in (200, 201, 202), r.text
    [run] = client.get("/v1/replays", headers=admin).json()["items"]
    assert run["schedule_id"] is not None
    name = run["name"]
    assert re.fullmatch(r"nightly production \d{4}-\d\d-\d\d \d\d:\d\d UTC", name), name
    due = datetime.strptime(name.removeprefix("nightly production "), "%Y-%m-%d %H:%M UTC")
    assert abs(due.replace(tzinfo=UTC) - datetime.now(UTC)) < timedelta(hours=1)
