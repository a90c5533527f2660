"""Concurrent duplicates of an idempotent POST get the documented answer, never a 500: the one
stored replay run, screening or verification (201 once, 200 for the rest), or 409 for a
schedule's name. On
PostgreSQL the loser of the race waits on the unique index and gets UniqueViolation; on SQLite
it gets "UNIQUE constraint failed" (issue 20). Each kind is raced twice: real concurrent
requests released at once, and a deterministic race (the lookup before the insert misses the
row a concurrent request committed, so the insert hits the constraint)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from replay_audit.audits import repository as audits_repository
from replay_audit.audits.models import AuditSchedule
from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.db.unit_of_work import session_scope
from replay_audit.engine.hashing import weights_sha256
from replay_audit.replays import repository as replays_repository
from replay_audit.replays.models import ReplayRun
from replay_audit.screenings import repository as screenings_repository
from replay_audit.screenings.models import Screening
from replay_audit.verifications import repository as verifications_repository
from replay_audit.verifications.models import Verification
from tests.audits.conftest import schedule_body
from tests.replays.conftest import HoldingRunner, ingest

THREADS = 16
TINY_SHA = weights_sha256(BUNDLED_MODEL_DIR)


def _trace(i: int) -> dict[str, Any]:
    return {
        "model": {"name": "m", "weights_sha256": "a" * 64, "vocab_size": 100},
        "config": {"dtype": "bf16"},
        "prompt_token_ids": [1, 2, i],
        "output_token_ids": [3, 4],
    }


@dataclasses.dataclass
class Kind:
    path: str
    table: type[Any]
    again: int  # the status of every duplicate
    lookup: tuple[Any, str]  # (repository module, function) the service asks before inserting


KINDS = {
    "replay": Kind(
        "/v1/replays", ReplayRun, 200, (replays_repository, "get_run_by_idempotency_key")
    ),
    "screening": Kind(
        "/v1/screenings", Screening, 200, (screenings_repository, "get_by_idempotency_key")
    ),
    "verification": Kind(
        "/v1/verifications",
        Verification,
        200,
        (verifications_repository, "get_by_idempotency_key"),
    ),
    "schedule": Kind(
        "/v1/audits/schedules", AuditSchedule, 409, (audits_repository, "get_schedule_by_name")
    ),
}


def _body(kind: str, client: TestClient, h: dict[str, str]) -> dict[str, Any]:
    if kind == "replay":
        ids = ingest(client, h, [_trace(1), _trace(2)])
        return {"trace_ids": ids, "targets": [{"dtype": "fp16"}], "idempotency_key": "k"}
    if kind == "screening":
        prompts = [{"prompt_token_ids": [5, 6, 7]}]
        return {"model_sha256": TINY_SHA, "prompts": prompts, "idempotency_key": "k"}
    if kind == "verification":
        ingest(client, h, [_trace(1), _trace(2)])
        return {"filter": {"model_name": "m"}, "idempotency_key": "k"}
    return schedule_body()


@pytest.fixture
def held(app: FastAPI) -> HoldingRunner:
    runner = HoldingRunner()
    app.state.queue = dataclasses.replace(app.state.queue, runner=runner)
    return runner


def _rows(db_url: str, table: type[Any]) -> int:
    with session_scope(db_url) as s:
        return int(s.scalar(select(func.count()).select_from(table)) or 0)


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_duplicates_get_the_idempotent_answer(
    app: FastAPI,
    held: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    db_url: str,
    kind: str,
) -> None:
    h = headers("admin")
    body = _body(kind, TestClient(app), h)
    barrier = threading.Barrier(THREADS)

    def post(_: int) -> tuple[int, str]:
        client = TestClient(app, raise_server_exceptions=False)
        barrier.wait()
        r = client.post(KINDS[kind].path, json=body, headers=h)
        return r.status_code, r.text

    with ThreadPoolExecutor(THREADS) as pool:
        answers = list(pool.map(post, range(THREADS)))
    statuses = sorted(status for status, _ in answers)
    assert statuses == sorted([KINDS[kind].again] * (THREADS - 1) + [201]), answers
    if kind != "schedule":
        assert len({text.split('"id":"')[1][:30] for _, text in answers}) == 1
    assert _rows(db_url, KINDS[kind].table) == 1
    assert len(held.specs) == (kind != "schedule")  # one job, enqueued once


@pytest.mark.parametrize("kind", KINDS)
def test_an_insert_that_loses_the_race_answers_with_the_winner(
    app: FastAPI,
    held: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    client = TestClient(app, raise_server_exceptions=False)
    h = headers("admin")
    body = _body(kind, client, h)
    first = client.post(KINDS[kind].path, json=body, headers=h)
    assert first.status_code == 201, first.text
    module, name = KINDS[kind].lookup
    real, calls = getattr(module, name), []

    def blind_first(*args: Any) -> Any:  # the row was not committed yet when it looked
        calls.append(args)
        return None if len(calls) == 1 else real(*args)

    monkeypatch.setattr(module, name, blind_first)
    again = client.post(KINDS[kind].path, json=body, headers=h)
    assert again.status_code == KINDS[kind].again, again.text
    if kind == "schedule":  # and a rename that races for a taken name
        assert again.json()["field"] == "name"
        other = client.post(KINDS[kind].path, json=schedule_body(name="b"), headers=h).json()["id"]
        calls.clear()
        r = client.patch(f"{KINDS[kind].path}/{other}", json={"name": body["name"]}, headers=h)
        assert r.status_code == 409 and r.json()["field"] == "name", r.text
    else:
        assert again.json()["id"] == first.json()["id"] and again.json()["created"] is False
    assert _rows(db_url, KINDS[kind].table) == 1 + (kind == "schedule")
