"""Which traces a replay request selects: a `filter` selects greedy traces only (a non-greedy
trace in the project is skipped, not an error), explicit `trace_ids` must all be greedy. On
SQLite and PostgreSQL (the `db_url` fixture)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.replays.conftest import HoldingRunner, all_results, ingest

pytestmark = pytest.mark.usefixtures("worker_env")

PROMPTS = [[i, (i * 5) % 11, 3] for i in range(1, 7)]
FP16 = {"dtype": "fp16"}
SAMPLED = {"strategy": "sample", "max_new_tokens": 12}


def _replayed(client: TestClient, h: dict[str, str], runner: HoldingRunner, body: Any) -> set[str]:
    r = client.post("/v1/replays", json={**body, "targets": [FP16]}, headers=h)
    assert r.status_code == 201, r.text
    runner.run_all()
    run = client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()
    assert run["status"] == "done", run
    return {x["trace_id"] for x in all_results(client, r.json()["id"], h)}


def test_a_broad_filter_skips_non_greedy_traces(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    greedy = ingest(client, h, [logged_trace(p) for p in PROMPTS[:3]])
    (sampled,) = ingest(client, h, [logged_trace(PROMPTS[3], decoding=SAMPLED)])
    # One sampled trace in the project used to fail every broad filter with a 422.
    assert _replayed(client, h, runner, {"filter": {}}) == set(greedy)
    assert _replayed(client, h, runner, {"filter": {"tag": "production"}}) == set(greedy)
    assert sampled not in _replayed(client, h, runner, {"filter": {"model_name": "fake"}})


def test_a_filter_of_only_non_greedy_traces_selects_nothing(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    ingest(client, h, [logged_trace(PROMPTS[0], decoding=SAMPLED, tags=["sampled"])])
    body = {"filter": {"tag": "sampled"}, "targets": [FP16]}
    r = client.post("/v1/replays", json=body, headers=h)
    assert r.status_code == 422 and r.json()["field"] == "filter", r.text
    assert runner.specs == []


def test_trace_ids_naming_a_non_greedy_trace_are_refused(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    greedy = ingest(client, h, [logged_trace(p) for p in PROMPTS[:2]])
    (sampled,) = ingest(client, h, [logged_trace(PROMPTS[2], decoding=SAMPLED)])
    body = {"trace_ids": [*greedy, sampled], "targets": [FP16]}
    r = client.post("/v1/replays", json=body, headers=h)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "trace_ids" and sampled in r.json()["detail"]
    assert not any(i in r.json()["detail"] for i in greedy)
    assert runner.specs == []


def test_filter_field_names(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    both = ingest(client, h, [logged_trace(PROMPTS[0], tags=["production", "eu"])])
    ingest(client, h, [logged_trace(PROMPTS[1], tags=["production"])])
    # `tags` (the audit selection's name) works beside `tag`: all of them must be carried.
    assert _replayed(client, h, runner, {"filter": {"tags": ["production", "eu"]}}) == set(both)
    assert _replayed(client, h, runner, {"filter": {"tag": "eu", "tags": ["production"]}}) == set(
        both
    )
    # A time without a zone means UTC, as in GET /v1/traces (it used to reach the database
    # naive and fail).
    window = {"created_after": "2000-01-01T00:00:00", "created_before": "2999-01-01T00:00:00"}
    assert len(_replayed(client, h, runner, {"filter": window})) == 2
