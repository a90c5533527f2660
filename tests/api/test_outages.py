"""Dependency outages are clear 503s, never 500s or silent successes (issue 10, defect 7).

- The job queue: the RQ runner pointed at a TCP port nobody listens on. `POST /v1/replays`
  answers 503 before storing anything, `/healthz` names the queue. A queue that fails after
  the commit (the unit of work's after-commit enqueue) answers 503 saying the run is kept for
  the reconciler.
- The database: the app talks to the real PostgreSQL through a TCP proxy this test starts and
  stops (the machine's shared PostgreSQL is never touched). While the proxy is down, the API
  answers 503 naming the database, `/healthz` says so, and the UI without a session cookie still
  redirects to sign-in; once it is back, the same requests succeed again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from replay_audit.api.app import create_app
from replay_audit.config import Settings
from replay_audit.db.engine import dispose_engines
from replay_audit.exceptions import QueueUnavailable
from replay_audit.queue import JobSpec
from replay_audit.replays.models import ReplayRun
from replay_audit.ui import audit_pages as ui_audit_pages
from replay_audit.ui import pages as ui_pages
from tests.conftest import empty_all_tables
from tests.replays.conftest import ingest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _trace(i: int) -> dict[str, Any]:
    return {
        "external_id": f"outage-{i}",
        "model": {"name": "m", "weights_sha256": "a" * 64, "vocab_size": 100},
        "config": {"dtype": "bf16"},
        "prompt_token_ids": [1, 2, i],
        "output_token_ids": [3, 4],
    }


# -- the job queue --------------------------------------------------------------------------


def test_replay_with_redis_unreachable_is_503_and_stores_nothing(
    make_client: Callable[..., TestClient], headers: Callable[..., dict[str, str]], db_url: str
) -> None:
    client = make_client(runner="rq", redis_url=f"redis://127.0.0.1:{_free_port()}/0")
    h = headers("admin")
    ids = ingest(client, h, [_trace(1), _trace(2)])
    r = client.post(
        "/v1/replays", json={"trace_ids": ids, "targets": [{"dtype": "fp16"}]}, headers=h
    )
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["error"] == "QueueUnavailable" and "Redis" in body["detail"]
    from replay_audit.db.unit_of_work import session_scope

    with session_scope(db_url) as s:
        assert s.query(ReplayRun).count() == 0  # refused before anything was written
    health = client.get("/healthz")
    assert health.status_code == 503
    assert health.json()["database"] == "ok" and "Redis" in health.json()["queue"]


def test_audit_run_now_with_redis_unreachable_is_503_and_leaves_no_run(
    make_client: Callable[..., TestClient], headers: Callable[..., dict[str, str]], db_url: str
) -> None:
    from replay_audit.audits.models import AuditRun
    from replay_audit.db.unit_of_work import session_scope
    from tests.audits.conftest import schedule_body

    client = make_client(runner="rq", redis_url=f"redis://127.0.0.1:{_free_port()}/0")
    h = headers("admin")
    ingest(client, h, [_trace(i) | {"tags": ["production"]} for i in range(3)])
    sid = client.post("/v1/audits/schedules", json=schedule_body(), headers=h).json()["id"]
    r = client.post(f"/v1/audits/schedules/{sid}/runs", headers=h)
    assert r.status_code == 503 and r.json()["error"] == "QueueUnavailable", r.text
    with session_scope(db_url) as s:
        assert s.query(AuditRun).count() == 0  # no run left failed: it starts once Redis is back


class _QueueFailingAfterCommit:
    """A runner whose queue goes away between the check and the enqueue (the race the
    after-commit path exists for): ping succeeds, enqueue raises what RQRunner raises."""

    def __init__(self) -> None:
        self.tried: list[JobSpec] = []

    def ping(self) -> None:
        pass

    def enqueue(self, spec: JobSpec) -> None:
        self.tried.append(spec)
        raise QueueUnavailable("the job queue (Redis) is unreachable: connection refused")

    def is_queued(self, job_id: str) -> bool:
        return False


def test_queue_failing_after_commit_is_503_and_the_run_is_kept_for_the_reconciler(
    client: TestClient, headers: Callable[..., dict[str, str]], db_url: str
) -> None:
    runner = _QueueFailingAfterCommit()
    state = client.app.state  # type: ignore[attr-defined]
    state.queue = dataclasses.replace(state.queue, runner=runner)
    h = headers("admin")
    ids = ingest(client, h, [_trace(1)])
    r = client.post(
        "/v1/replays", json={"trace_ids": ids, "targets": [{"dtype": "fp16"}]}, headers=h
    )
    assert r.status_code == 503, r.text
    assert "reconcile" in r.json()["detail"] and runner.tried
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.replays import repository

    with session_scope(db_url) as s:
        (run,) = s.query(ReplayRun).all()
        assert run.status == "queued"
        assert [j.id for j in repository.unfinished_jobs(s)] == [int(runner.tried[0].args[0])]


# -- the database ---------------------------------------------------------------------------


class TcpProxy:
    """A TCP forwarder from an ephemeral local port to `target`; `stop()` closes the listener
    and every connection (the database 'goes away'), `start()` brings it back on the same
    port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = _free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def proxied_postgres(postgres_database_url: str) -> Iterator[tuple[str, TcpProxy]]:
    url = make_url(postgres_database_url)
    proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432))
    proxy.start()
    try:
        yield url.set(port=proxy.port).render_as_string(hide_password=False), proxy
    finally:
        proxy.stop()
        dispose_engines()
        # The session's database is every later test's too: its key and traces go with it (a
        # test counting the keys it made found this one).
        empty_all_tables(postgres_database_url)


@pytest.mark.postgres
def test_database_outage_at_run_time_is_503_and_recovers(
    proxied_postgres: tuple[str, TcpProxy],
) -> None:
    url, proxy = proxied_postgres
    settings = Settings(_env_file=None, database_url=url)  # type: ignore[call-arg]
    from replay_audit.auth.service import create_api_key
    from replay_audit.db.unit_of_work import session_scope

    with session_scope(url) as s:
        key = create_api_key(s, "outage", "admin").key
    h = {"X-API-Key": key}
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        assert client.get("/v1/traces", headers=h).status_code == 200
        assert client.get("/healthz").json()["database"] == "ok"
        proxy.stop()
        r = client.get("/v1/traces", headers=h)
        assert r.status_code == 503, r.text
        assert r.json()["error"] == "DatabaseUnavailable" and "database" in r.json()["detail"]
        post = client.post("/v1/traces", json=_trace(1), headers=h)
        assert post.status_code == 503, post.text
        health = client.get("/healthz")
        assert health.status_code == 503 and health.json()["database"] != "ok"
        # The UI without a session cookie still sends the browser to sign in, on every page
        # that needs one (the cookie is checked before the database is asked).
        pages = [
            route.path
            for router in (ui_pages.router, ui_audit_pages.router)
            for route in router.routes
            if "GET" in (getattr(route, "methods", None) or ())
            and "sign-in" not in getattr(route, "path", "sign-in")
        ]
        assert "/runs" in pages and "/schedules" in pages
        for path in pages:
            url = "/ui" + path.replace("{run_id}", "rr_x").replace("{trace_id}", "tr_x")
            url = url.replace("{schedule_id}", "as_x")
            ui = client.get(url, follow_redirects=False)
            assert ui.status_code in (303, 307), (url, ui.status_code)
            # the root page only points at the runs list, which then asks to sign in
            expected = "/ui/runs" if path == "/" else "/ui/sign-in"
            assert expected in ui.headers["location"], (url, ui.headers["location"])
        proxy.start()
        assert client.get("/v1/traces", headers=h).status_code == 200
        assert client.post("/v1/traces", json=_trace(2), headers=h).status_code == 201
        assert client.get("/healthz").status_code == 200
