"""Engines and session factories, one per database URL.

SQLite (the embedded default) is set up for a small multi-threaded server: WAL journal (readers
never block the writer), foreign keys enforced, a busy timeout so a second writer waits instead
of failing, and SQLAlchemy (not the sqlite3 module) emitting BEGIN. Write transactions start with
`BEGIN IMMEDIATE`: taking the write lock up front means two requests that both read and then
write can never deadlock on a lock upgrade (SQLITE_BUSY that no timeout can fix). Read-only units
of work (`read_only=True`) start with a plain deferred BEGIN and run concurrently with the writer.

PostgreSQL goes through psycopg 3 (`postgresql+psycopg://`, which `Settings` normalises to). A
pooled connection is pinged before use when it sat idle a second or more (`_ping_when_idle`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Final

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

#: Execution option marking a connection's transaction as read-only (SQLite: deferred BEGIN).
READ_ONLY_OPTION: Final = "replay_audit_read_only"
#: Seconds a pooled PostgreSQL connection may sit idle and still be used without a ping.
PING_IDLE_S: Final = 1.0
_IDLE_SINCE: Final = "replay_audit_idle_since"
#: Milliseconds a SQLite writer waits for the lock before "database is locked".
SQLITE_BUSY_TIMEOUT_MS: Final = 30_000


def is_sqlite(url: str | URL) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def _sqlite_file(url: URL) -> Path | None:
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def dialect_insert(session: Session) -> Any:
    """The session's dialect's `insert` (PostgreSQL's or SQLite's): both have ON CONFLICT."""
    return (postgresql if session.get_bind().dialect.name == "postgresql" else sqlite).insert


def create_db_engine(database_url: str, **kwargs: Any) -> Engine:
    """A new Engine for `database_url`, configured as the module docstring says.

    Prefer `get_engine`, which keeps one engine (one connection pool) per URL.
    """
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        engine = create_engine(url, **kwargs)
        _ping_when_idle(engine)
        return engine

    path = _sqlite_file(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    connect_args = kwargs.pop("connect_args", {})
    connect_args.setdefault("check_same_thread", False)
    connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT_MS / 1000)
    engine = create_engine(url, connect_args=connect_args, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Hand transaction control to SQLAlchemy (see the "begin" hook below).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            if path is not None:
                cursor.execute("PRAGMA journal_mode=WAL")
                # Safe with WAL (a crash loses at most the last transactions, never corrupts).
                cursor.execute("PRAGMA synchronous=NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        read_only = connection.get_execution_options().get(READ_ONLY_OPTION, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def _ping_when_idle(engine: Engine) -> None:
    """SQLAlchemy's `pool_pre_ping`, for a connection that sat in the pool at least
    `PING_IDLE_S`: one back from a request a moment ago is taken as it is. The ping is a round
    trip of its own before every request's first statement (a quarter of a single POST's);
    where a connection died in between anyway (the server restarted within the second), the
    request fails as in an outage (503), and that error invalidates the pool."""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection: Any, record: Any) -> None:
        # `record.info` lives as long as the DBAPI connection: a new one is pinged first.
        record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get(_IDLE_SINCE)
        if since is not None and time.monotonic() - since < PING_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as e:
            # The pool throws this connection away and checks out another (up to 3 tries).
            raise exc.DisconnectionError(f"the pooled connection is dead: {e}") from e


_lock = threading.Lock()
_engines: dict[str, Engine] = {}
_sessionmakers: dict[str, sessionmaker[Session]] = {}


def get_engine(database_url: str) -> Engine:
    """The process-wide Engine for `database_url` (created on first use)."""
    with _lock:
        engine = _engines.get(database_url)
        if engine is None:
            engine = _engines[database_url] = create_db_engine(database_url)
        return engine


def get_sessionmaker(database_url: str) -> sessionmaker[Session]:
    """The process-wide session factory for `database_url`.

    Sessions do not expire objects on commit, so what a unit of work loaded stays readable after
    it committed (jobs build their result from it). This package knows no table: each domain's
    `models.py` imports the models its foreign keys and relationships name, so whichever domain
    a command or a job imports, the first session finds every class its mappers refer to.
    """
    engine = get_engine(database_url)
    with _lock:
        factory = _sessionmakers.get(database_url)
        if factory is None:
            factory = _sessionmakers[database_url] = sessionmaker(
                bind=engine, expire_on_commit=False
            )
        return factory


def dispose_engines() -> None:
    """Close every pooled connection and forget the engines (tests, after a fork)."""
    with _lock:
        engines = list(_engines.values())
        _engines.clear()
        _sessionmakers.clear()
    for engine in engines:
        engine.dispose()
