"""A pooled PostgreSQL connection is pinged before use only after it sat idle (`PING_IDLE_S`):
a dead one is then replaced without the caller noticing; one that died within the second
fails the statement once (an outage's 503 in the API), and the next checkout is a new one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from replay_audit.db import engine as engine_module
from replay_audit.db.engine import create_db_engine

pytestmark = pytest.mark.postgres


@pytest.fixture
def engine(postgres_database_url: str) -> Iterator[Engine]:
    engine = create_db_engine(postgres_database_url, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def _kill_pooled_connection(engine: Engine, postgres_database_url: str) -> int:
    """Terminate the backend of the engine's one pooled connection; its pid."""
    with engine.connect() as connection:
        pid = int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())
    killer = create_db_engine(postgres_database_url)
    try:
        with killer.connect() as connection:
            connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            connection.commit()
    finally:
        killer.dispose()
    return pid


def _backend_pid(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_an_idle_dead_connection_is_replaced_before_use(
    engine: Engine, postgres_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = _kill_pooled_connection(engine, postgres_database_url)
    monkeypatch.setattr(engine_module, "PING_IDLE_S", 0.0)  # idle long enough: pinged
    assert _backend_pid(engine) != dead


def test_a_connection_that_died_within_the_second_fails_once(
    engine: Engine, postgres_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = _kill_pooled_connection(engine, postgres_database_url)
    monkeypatch.setattr(engine_module, "PING_IDLE_S", 3600.0)  # just used: not pinged
    with pytest.raises(OperationalError):
        _backend_pid(engine)
    assert _backend_pid(engine) != dead
