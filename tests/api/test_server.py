"""Several API processes answer with TCP_NODELAY like one (issue 10, defect 12): the listening
socket of the multi-process server is bound as TCP, so asyncio turns Nagle off on every
connection it accepts. uvicorn's own multi-process socket does not (the check below shows it),
which cost every single POST a delayed ACK (~40 ms) with `serve --workers 2`."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import uvicorn

from replay_audit.api.server import TcpConfig, check_app_builds, run_processes, served_app
from replay_audit.queue import stop_runner
from tests.serving import free_port, wait_healthy


def _nodelay_of_accepted(sock: socket.socket) -> int:
    """TCP_NODELAY of a connection that an asyncio server on `sock` accepts."""

    async def main() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                s = transport.get_extra_info("socket")
                seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        host, port = sock.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        try:
            return await asyncio.wait_for(seen, 5)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    return asyncio.run(main())


def test_the_multi_process_socket_gives_connections_tcp_nodelay() -> None:
    ours = TcpConfig("x:y", host="127.0.0.1", port=0).bind_socket()
    assert ours.proto == socket.IPPROTO_TCP
    assert _nodelay_of_accepted(ours) == 1


def test_uvicorns_own_multi_process_socket_does_not() -> None:
    # What `uvicorn.run(..., workers=2)` binds: if uvicorn fixes this, TcpConfig can go.
    theirs = uvicorn.Config("x:y", host="127.0.0.1", port=0).bind_socket()
    assert _nodelay_of_accepted(theirs) == 0


def test_a_served_app_hides_its_startup_objects_from_the_garbage_collector(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each process of `serve` freezes what exists once its app is built (`gc.freeze`): a full
    collection then walks only what came after (5-8 ms instead of 120 ms of a frozen process,
    every few hundred POSTs: the p99 of concurrent ingest, issue 20)."""
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", f"sqlite:///{tmp_path / 'db.sqlite'}")
    monkeypatch.setenv("REPLAY_AUDIT_SESSION_SECRET_FILE", str(tmp_path / "secret"))
    gc.unfreeze()
    try:
        app = served_app()
        assert app.state.settings.database_url.startswith("sqlite")
        # The app and its routes are out of the collector's sight, among all the rest.
        assert gc.get_freeze_count() > 10_000
        tracked = gc.get_objects()
        assert not any(o is app or o is app.router.routes for o in tracked)
        stop_runner(app.state.own_runner)
    finally:
        gc.unfreeze()


def broken_app() -> None:
    """An app factory that fails as one does when a package it needs is missing."""
    raise AssertionError("Package 'fastapi_offline' could not be found.")


def test_a_served_app_that_cannot_build_stops_serve_with_its_error() -> None:
    # uvicorn's supervisor would restart such workers forever; run_processes stops first.
    with pytest.raises(SystemExit) as stopped:
        run_processes(
            "tests.api.test_server:broken_app",
            host="127.0.0.1",
            port=0,
            workers=2,
            log_level="warning",
        )
    assert str(stopped.value) == (
        "the API cannot start: AssertionError: Package 'fastapi_offline' could not be found."
    )


def test_the_real_app_builds_in_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", f"sqlite:///{tmp_path / 'db.sqlite'}")
    check_app_builds("replay_audit.api.server:served_app")  # returns: it built


def test_plain_text_access_lines_keep_no_query_string(tmp_path: Path) -> None:
    """`serve`'s text logs (the default) write uvicorn's access lines without the query: a key
    put in `?api_key=` or a search term never reaches the log (issue 33). The path stays."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_AUDIT_")}
    env |= {
        "REPLAY_AUDIT_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}",
        "REPLAY_AUDIT_SCHEDULER": "off",
    }
    log = tmp_path / "serve.log"
    args = [sys.executable, "-m", "replay_audit", "serve", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=out, stderr=out)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log)
        answer = httpx.get(f"{base}/v1/traces?api_key=ra_SeCrEt123&model=zz-SeCrEt")
        assert answer.status_code == 401
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert '"GET /v1/traces HTTP/1.1" 401' in text, text
    assert "SeCrEt" not in text and "api_key" not in text
