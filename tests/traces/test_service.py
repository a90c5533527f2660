"""The trace functions other domains call (replays, audits): load by ids, select by filters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlalchemy.exc import InvalidRequestError

from replay_audit.auth.service import authenticate
from replay_audit.db.unit_of_work import session_scope
from replay_audit.traces import repository
from replay_audit.traces.models import Trace
from replay_audit.traces.selection import TraceSelection, is_greedy
from tests.factories import make_trace

ApiKeyFactory = Callable[..., str]


def _setup(client: TestClient, api_key: ApiKeyFactory, db_url: str) -> tuple[int, list[str]]:
    key = api_key("admin", "svc")
    traces = [make_trace(tags=["a"]), make_trace(tags=["b"]), make_trace(top_k=None, tags=["a"])]
    answer = client.post("/v1/traces:batch", json={"traces": traces}, headers={"X-API-Key": key})
    ids = [r["id"] for r in answer.json()["results"]]
    with session_scope(db_url) as session:
        project_id = authenticate(session, key).project_id
    return project_id, ids


def test_select_traces_filters_and_defers_the_arrays(
    client: TestClient, api_key: ApiKeyFactory, db_url: str
) -> None:
    project_id, ids = _setup(client, api_key, db_url)
    with session_scope(db_url) as session:
        stmt = repository.select_traces(project_id, TraceSelection(tags=("a",)))
        rows = list(session.execute(stmt).unique().scalars())
        assert sorted(r.public_id for r in rows) == sorted([ids[0], ids[2]])
        assert all(r.n_output_tokens == 6 for r in rows)
        with pytest.raises(InvalidRequestError):
            _ = rows[0].output_token_ids  # deferred with raiseload: no hidden query per row


def test_select_traces_greedy_reads_the_strategy_in_sql_like_is_greedy(
    client: TestClient, api_key: ApiKeyFactory, db_url: str
) -> None:
    project_id, ids = _setup(client, api_key, db_url)
    sampled, no_strategy = ids[1], ids[2]
    with session_scope(db_url) as session:
        session.execute(
            update(Trace).where(Trace.public_id == sampled).values(decoding={"strategy": "beam"})
        )
        session.execute(update(Trace).where(Trace.public_id == no_strategy).values(decoding={}))

    def selected(**kwargs: Any) -> set[str]:
        with session_scope(db_url) as session:
            stmt = repository.select_traces(project_id, TraceSelection(**kwargs))
            rows = list(session.execute(stmt).unique().scalars())
            assert all(is_greedy(r.decoding) == (r.public_id != sampled) for r in rows)
            return {r.public_id for r in rows}

    assert selected() == set(ids)
    assert selected(greedy=True) == {ids[0], no_strategy}  # no strategy is greedy
    assert selected(greedy=False) == {sampled}
    assert selected(greedy=True, tags=("a",)) == {ids[0], no_strategy}
