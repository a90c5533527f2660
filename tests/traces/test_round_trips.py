"""What a single POST /v1/traces costs PostgreSQL, in round trips, pinned (issue 20: with eight
clients on two cores, each round trip of each request queues behind the others).

The steady state (a key that passed within `api_key_cache_s`, a stored configuration) is four:
the pool's liveness ping, BEGIN, one statement that stores the key, the trace and its tags
(`traces.repository.insert_one_trace`), COMMIT. Counted from libpq's protocol trace
(`tests.round_trips`), so BEGIN, COMMIT and the ping count as much as a query.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import sessionmaker

from replay_audit.api.app import create_app
from replay_audit.auth.service import create_api_key
from replay_audit.config import Settings
from replay_audit.db.engine import create_db_engine
from replay_audit.db.unit_of_work import session_scope
from tests.conftest import empty_all_tables
from tests.factories import make_trace
from tests.round_trips import RoundTrips

pytestmark = pytest.mark.postgres


@pytest.fixture
def traced(postgres_database_url: str) -> Iterator[tuple[TestClient, RoundTrips, str]]:
    """A client of an app whose sessions use one traced connection, and the database URL."""
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


def test_a_new_trace_in_a_stored_configuration_takes_four_round_trips(
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
    assert (trips, _kinds(statements)) == (4, [";", "BEGIN", "WITH", "COMMIT"]), statements

    # A repeat: the statement inserts nothing, and one query finds the stored trace's id.
    again = client.post("/v1/traces", json=make_trace(seed=5), headers=h)
    assert again.status_code == 201
    counter.take()
    again = client.post("/v1/traces", json=make_trace(seed=5), headers=h)
    assert again.status_code == 200
    trips, statements = counter.take()
    assert (trips, _kinds(statements)) == (5, [";", "BEGIN", "WITH", "SELECT", "COMMIT"])
