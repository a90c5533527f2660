"""Every command that opens a database session works in a fresh process, on a fresh SQLite file
and on a fresh PostgreSQL database: db upgrade/current, keys create, reconcile, the audit
commands, the scheduler loop, an RQ worker and serve.

A fresh process matters: the test process has imported every ORM model long before, so a
command that opens a session without them (`reconcile` once crashed with "expression 'Project'
failed to locate a name") passes in-process and fails for the user.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from replay_audit.api.app import create_app
from replay_audit.config import Settings
from replay_audit.db import migration
from replay_audit.db.engine import dispose_engines
from tests.cli.conftest import assert_no_traceback, cli_args, cli_env, run_cli
from tests.cli.test_interrupt import Output
from tests.conftest import RedisNamespace

pytestmark = pytest.mark.slow

KEY = re.compile(r"\bra_[0-9a-f]{12}_[A-Za-z0-9_-]{43}\b")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fresh_url(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    empty_postgres_database: Callable[[], str],
) -> Iterator[str]:
    """A database nobody has migrated yet."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
    else:
        yield empty_postgres_database()
    dispose_engines()


def _ok(args: list[str], url: str, cwd: Path) -> str:
    proc = run_cli(args, env=cli_env(database_url=url), cwd=cwd)
    assert proc.returncode == 0, f"{args}: {proc.stdout}{proc.stderr}"
    assert_no_traceback(proc)
    return proc.stdout


def _schedule(url: str, key: str) -> str:
    settings = Settings(_env_file=None, database_url=url)  # type: ignore[call-arg]
    body = {
        "name": "nightly",
        "selection": {"model_name": "nobody"},  # no traces: the runs replay nothing
        "sample_size": 4,
        "replay": {"targets": [{"dtype": "fp16", "device": "cpu"}], "compare_with": "self"},
    }
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/audits/schedules", json=body, headers={"X-API-Key": key})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


@pytest.mark.redis
def test_every_database_command_in_a_fresh_process(
    fresh_url: str, tmp_path: Path, rq_redis: RedisNamespace
) -> None:
    assert "database at revision" in _ok(["db", "upgrade"], fresh_url, tmp_path)
    assert f"current: {migration.head_revision()}" in _ok(["db", "current"], fresh_url, tmp_path)
    created = _ok(["keys", "create", "--project", "acme", "--role", "admin"], fresh_url, tmp_path)
    (key,) = KEY.findall(created)
    assert "re-enqueued 0 jobs" in _ok(["reconcile"], fresh_url, tmp_path)

    sid = _schedule(fresh_url, key)
    assert sid in _ok(["audit", "list"], fresh_url, tmp_path)
    assert sid in _ok(["audit", "list", "--project", "acme"], fresh_url, tmp_path)
    _ok(["audit", "run-now", "--schedule", sid], fresh_url, tmp_path)
    _ok(["audit", "catch-up", "--schedule", sid], fresh_url, tmp_path)
    assert f"trend of {sid}" in _ok(["audit", "trend", "--schedule", sid], fresh_url, tmp_path)
    assert "errors 0" in _ok(["audit", "tick"], fresh_url, tmp_path)

    # The scheduler loop: three ticks (each reconciles the queue), then Ctrl-C.
    proc = subprocess.Popen(
        cli_args("scheduler", "--interval-s", "0.2"),
        env=cli_env(database_url=fresh_url),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    log = Output(proc.stdout)
    try:
        deadline = time.monotonic() + 120
        while log.text.count("audit tick:") < 3:
            assert proc.poll() is None and time.monotonic() < deadline, log.text[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    out = log.text
    assert proc.returncode in (0, 130), out
    assert_no_traceback(proc, out)
    assert "failed" not in out, out

    # An RQ worker (its jobs open sessions): a burst over an empty queue of this test's namespace.
    env = cli_env(database_url=fresh_url, runner="rq") | rq_redis.env()
    worker = run_cli(["worker", "--queue", "cpu", "--device", "cpu", "--burst"], env=env,
                     cwd=tmp_path)  # fmt: skip
    assert worker.returncode == 0, worker.stdout + worker.stderr
    assert_no_traceback(worker)

    # serve on the same database: up, answering, no second admin key, stopped by SIGTERM.
    port = _free_port()
    proc = subprocess.Popen(
        cli_args("serve", "--port", str(port), "--log-level", "warning"),
        env=cli_env(database_url=fresh_url), cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _answers(f"http://127.0.0.1:{port}/v1/traces", key):
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert_no_traceback(proc, out)
    assert not KEY.findall(out), out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str, key: str) -> bool:
    try:
        return httpx.get(url, headers={"X-API-Key": key}, timeout=2).status_code == 200
    except httpx.TransportError:
        return False
