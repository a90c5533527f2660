"""Idempotency under concurrent retries: enforced by the unique constraints, on both databases."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from replay_audit.auth.schemas import Principal
from replay_audit.auth.service import authenticate
from replay_audit.db.unit_of_work import session_scope
from replay_audit.traces import service
from replay_audit.traces.models import Trace
from replay_audit.traces.schemas import TraceCreate
from tests.factories import make_trace
from tests.traces.test_ingest import count_rows

ApiKeyFactory = Callable[..., str]
THREADS = 8


def _post_concurrently(
    app: FastAPI, key: str, bodies: list[dict[str, Any]]
) -> list[httpx.Response]:
    """POST each body from its own thread and client, all released at once."""
    barrier = threading.Barrier(len(bodies))

    def post(body: dict[str, Any]) -> httpx.Response:
        client = TestClient(app)
        barrier.wait()
        return client.post("/v1/traces", json=body, headers={"X-API-Key": key})

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


#: Whether the racing traces' configuration is stored before the race: then, on PostgreSQL,
#: each POST is the one statement of `repository.insert_one_trace`, else the general path.
CONFIG_STORED = pytest.mark.parametrize("config_stored", [False, True])


def _store_configuration(app: FastAPI, key: str, config_stored: bool) -> int:
    """Store a trace of the factories' configuration first when asked; the traces stored."""
    if not config_stored:
        return 0
    answer = TestClient(app).post("/v1/traces", json=make_trace(), headers={"X-API-Key": key})
    assert answer.status_code == 201
    return 1


@CONFIG_STORED
def test_concurrent_duplicate_posts_store_one_trace(
    app: FastAPI, api_key: ApiKeyFactory, db_url: str, config_stored: bool
) -> None:
    key = api_key("submitter")
    before = _store_configuration(app, key, config_stored)
    trace = make_trace(seed=99, n_prompt=64, n_output=64)
    answers = _post_concurrently(app, key, [trace] * THREADS)
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200] * (THREADS - 1) + [201], [a.text for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1
    assert count_rows(db_url, Trace) == before + 1


@CONFIG_STORED
def test_concurrent_posts_racing_for_one_external_id(
    app: FastAPI, api_key: ApiKeyFactory, db_url: str, config_stored: bool
) -> None:
    key = api_key("submitter")
    before = _store_configuration(app, key, config_stored)
    bodies = [make_trace(external_id="shared") for _ in range(THREADS)]
    answers = _post_concurrently(app, key, bodies)
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [201] + [409] * (THREADS - 1), [a.text for a in answers]
    assert all(a.json()["field"] == "external_id" for a in answers if a.status_code == 409)
    assert count_rows(db_url, Trace) == before + 1


def _principal(db_url: str, key: str) -> Principal:
    with session_scope(db_url) as session:
        return authenticate(session, key)


def _race_with_open_transaction(
    app: FastAPI, db_url: str, key: str, *, commit: bool
) -> tuple[httpx.Response, str]:
    """Hold an uncommitted insert of a trace while a client posts the same trace; then commit
    (or roll back) and return the client's answer and the held trace's id."""
    trace = make_trace(seed=1234)
    principal = _principal(db_url, key)
    client = TestClient(app)
    outcome: dict[str, httpx.Response] = {}
    poster = threading.Thread(
        target=lambda: outcome.setdefault(
            "answer", client.post("/v1/traces", json=trace, headers={"X-API-Key": key})
        )
    )
    held_id = ""
    try:
        with session_scope(db_url) as session:
            (result,) = service.ingest_traces(
                session, principal.project_id, [TraceCreate.model_validate(trace)]
            )
            assert result.status == 201 and result.id is not None
            held_id = result.id
            poster.start()
            # The poster must wait for us: the unique index (PostgreSQL) or the write lock
            # (SQLite) holds it until this transaction ends.
            poster.join(timeout=0.5)
            assert poster.is_alive(), "the concurrent post did not wait for the open insert"
            if not commit:
                raise _Abort
    except _Abort:
        pass
    poster.join(timeout=30)
    assert not poster.is_alive()
    return outcome["answer"], held_id


class _Abort(Exception):
    pass


@CONFIG_STORED
def test_post_waits_for_an_uncommitted_duplicate_then_returns_its_id(
    app: FastAPI, api_key: ApiKeyFactory, db_url: str, config_stored: bool
) -> None:
    key = api_key("admin")
    before = _store_configuration(app, key, config_stored)
    answer, held_id = _race_with_open_transaction(app, db_url, key, commit=True)
    assert answer.status_code == 200 and answer.json()["id"] == held_id
    assert count_rows(db_url, Trace) == before + 1


@CONFIG_STORED
def test_post_after_a_rolled_back_duplicate_creates_the_trace(
    app: FastAPI, api_key: ApiKeyFactory, db_url: str, config_stored: bool
) -> None:
    key = api_key("admin")
    before = _store_configuration(app, key, config_stored)
    answer, held_id = _race_with_open_transaction(app, db_url, key, commit=False)
    assert answer.status_code == 201 and answer.json()["id"] != held_id
    assert count_rows(db_url, Trace) == before + 1


def test_concurrent_batches_of_the_same_traces_in_other_orders(
    app: FastAPI, api_key: ApiKeyFactory, db_url: str
) -> None:
    """Retries of one batch, shuffled, racing: no deadlock, every trace stored once."""
    key = api_key("submitter")
    traces = [make_trace(n_prompt=16, n_output=16) for _ in range(40)]
    orders = [traces, traces[::-1], traces[1::2] + traces[::2], traces[::2] + traces[1::2]]
    barrier = threading.Barrier(len(orders))

    def post(batch: list[dict[str, Any]]) -> httpx.Response:
        client = TestClient(app)
        barrier.wait()
        return client.post("/v1/traces:batch", json={"traces": batch}, headers={"X-API-Key": key})

    with ThreadPoolExecutor(len(orders)) as pool:
        answers = list(pool.map(post, orders))
    assert [a.status_code for a in answers] == [207] * len(orders), [a.text for a in answers]
    created = sum(r["status"] == 201 for a in answers for r in a.json()["results"])
    assert created == len(traces)
    assert all(r["status"] in (200, 201) for a in answers for r in a.json()["results"])
    assert count_rows(db_url, Trace) == len(traces)
