"""Fixtures for tests that need the app behind a real HTTP server (keep-alive, fuzzing)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import uvicorn
from fastapi import FastAPI

ServeApp = Callable[[FastAPI], AbstractContextManager[tuple[str, int]]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def _serve(app: FastAPI) -> Iterator[tuple[str, int]]:
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=_free_port(), log_level="critical", lifespan="off"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield "127.0.0.1", server.config.port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def serve() -> ServeApp:
    """`with serve(app) as (host, port):` the app behind uvicorn on a free local port."""
    return _serve
