"""What a single POST /v1/traces costs PostgreSQL, in round trips, pinned (issue 20: with eight
clients on two cores, each round trip of each request queues behind the others).

The steady state (a key that passed within `api_key_cache_s`, a stored configuration, a pooled
connection used within `PING_IDLE_S`) is three: BEGIN, one statement that stores the key, the
trace and its tags (`traces.repository.insert_one_trace`), COMMIT. Counted from libpq's protocol
trace (`tests.round_trips`), so BEGIN, COMMIT and the pool's ping count as much as a query.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import sessionmaker

from replay_audit.api.app import create_app
from replay_audit.auth.service import create_api_key
from replay_audit.config import Settings
from replay_audit.db import engine as engine_module
from replay_audit.db.engine import create_db_engine
from replay_audit.db.unit_of_work import session_scope
from tests.conftest import empty_all_tables
from tests.factories import make_trace
from tests.round_trips import RoundTrips

pytestmark = pytest.mark.postgres


@pytest.fixture
def traced(
    postgres_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TestClient, RoundTrips, str]]:
    """A client of an app whose sessions use one traced connection, and the database URL.
    The connection counts as busy however slow the machine (its ping has a test below)."""
    monkeypatch.setattr(engine_module, "PING_IDLE_S", 3600.0)
    engine = create_db_engine(postgres_database_url, pool_size=1)
    counter = RoundTrips(engine)
    app = create_app(Settings(_env_file=None, database_url=postgres_database_url))  # type: ignore[call-arg]
    app.state.sessionmaker = sessionmaker(bind=engine, expire_on_commit=False)
    try:
        with TestClient(app) as client:
            yield client, counter, postgres_database_url
    finally:
        engine.dispose()
        counter.close()
        empty_all_tables(postgres_database_url)


def _kinds(statements: list[str]) -> list[str]:
    return [s.split(" ")[0].upper() for s in statements]


def test_a_new_trace_in_a_stored_configuration_takes_three_round_trips(
    traced: tuple[TestClient, RoundTrips, str],
) -> None:
    client, counter, url = traced
    with session_scope(url) as session:
        h = {"X-API-Key": create_api_key(session, "acme", "submitter").key}
    # The first trace of a configuration stores it (the general path); the key is checked.
    first = client.post("/v1/traces", json=make_trace(tags=["a"]), headers=h)
    assert first.status_code == 201, first.text
    counter.take()

    answer = client.post("/v1/traces", json=make_trace(tags=["a", "b"]), headers=h)
    assert answer.status_code == 201, answer.text
    trips, statements = counter.take()
    assert (trips, _kinds(statements)) == (3, ["BEGIN", "WITH", "COMMIT"]), statements

    # A repeat: the statement inserts nothing, and one query finds the stored trace's id.
    again = client.post("/v1/traces", json=make_trace(seed=5), headers=h)
    assert again.status_code == 201
    counter.take()
    again = client.post("/v1/traces", json=make_trace(seed=5), headers=h)
    assert again.status_code == 200
    trips, statements = counter.take()
    assert (trips, _kinds(statements)) == (4, ["BEGIN", "WITH", "SELECT", "COMMIT"])


def test_a_connection_idle_for_a_while_is_pinged_first(
    traced: tuple[TestClient, RoundTrips, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, counter, url = traced
    with session_scope(url) as session:
        h = {"X-API-Key": create_api_key(session, "acme", "submitter").key}
    assert client.post("/v1/traces", json=make_trace(), headers=h).status_code == 201
    monkeypatch.setattr(engine_module, "PING_IDLE_S", 0.0)
    counter.take()
    assert client.post("/v1/traces", json=make_trace(), headers=h).status_code == 201
    trips, statements = counter.take()
    assert (trips, _kinds(statements)) == (4, [";", "BEGIN", "WITH", "COMMIT"]), statements
