"""Serving the app with several processes, with the latency of one.

uvicorn's multi-process mode binds its listening socket as `socket.socket(AF_INET)`, whose
`proto` is 0. asyncio turns Nagle's algorithm off (TCP_NODELAY) only on accepted sockets whose
`proto` is IPPROTO_TCP, so with `--workers 2` every response went out under Nagle and met the
client's delayed ACK: single-POST p50 52 ms against 9 ms with one process (issue 10, defect 12).
Binding the socket with IPPROTO_TCP gives the accepted connections the protocol asyncio
expects, and they get TCP_NODELAY like the single-process server's.
"""

from __future__ import annotations

import copy
import gc
import logging
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import uvicorn
import uvicorn.config
from uvicorn.supervisors import Multiprocess

if TYPE_CHECKING:
    from fastapi import FastAPI


class TcpConfig(uvicorn.Config):
    """A uvicorn config whose TCP listening socket says it is TCP (see the module docstring)."""

    def bind_socket(self) -> socket.socket:
        if self.uds is not None or self.fd is not None:
            return super().bind_socket()
        family = socket.AF_INET6 if self.host and ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.set_inheritable(True)
        return sock


def freeze_startup_objects() -> None:
    """Hide every object alive now (most of the process) from the cyclic garbage collector,
    once the app is built and before it answers.

    A full collection otherwise walks all of them: 120 ms during which the process answers
    nothing, about every 500 single POSTs (objects of requests in flight are promoted to the
    oldest generation and trigger it), which made the p99 of concurrent ingest (issue 20).
    With them frozen it walks what came after: 5-8 ms. Reference counting still frees
    everything that is not in a cycle, frozen or not."""
    gc.collect()
    gc.freeze()


def served_app() -> FastAPI:
    """The app of one of `serve --workers N`'s processes, from the environment. Imported here,
    not with the module: each process imports this module (unpickling `TcpConfig`) before it
    answers uvicorn's health pings, and a process silent for 5 s is killed and replaced."""
    from replay_audit.api.app import create_app
    from replay_audit.config import get_settings
    from replay_audit.telemetry.log import configure_logging

    settings = get_settings()
    if settings.log_format == "json":  # uvicorn set up text lines in this process already
        configure_logging("json")
    app = create_app(settings)
    freeze_startup_objects()
    return app


class NoQueryString(logging.Filter):
    """Drops the query string from uvicorn's access lines: a query can carry what must not
    reach a log (a key put in `?api_key=`, a search term), and the path says the route."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            record.args = (*args[:2], args[2].partition("?")[0], *args[3:])
        return True


def uvicorn_logging(log_format: str) -> dict[str, Any]:
    """uvicorn's logging options: its own text setup with its access lines' query strings
    dropped (`NoQueryString`), or none with JSON lines (ours, on the root logger), and then
    no access log of its own (the app's access lines carry the request id: `api.observe`)."""
    if log_format == "json":
        return {"log_config": None, "access_log": False}
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["filters"] = {"no_query": {"()": f"{__name__}.NoQueryString"}}
    config["handlers"]["access"]["filters"] = ["no_query"]
    return {"log_config": config}


def run_processes(
    app: str, *, host: str, port: int, workers: int, log_level: str, log_format: str = "text"
) -> None:
    """Serve the app factory `app` ("module:function") from `workers` processes, once one
    process like them has built it (`check_app_builds`)."""
    check_app_builds(app)
    config = TcpConfig(
        app,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        **uvicorn_logging(log_format),
    )
    sock = config.bind_socket()
    # The children get the socket pickled (multiprocessing keeps its family, type and proto).
    Multiprocess(config, sockets=[sock]).run()


def check_app_builds(app: str) -> None:
    """Build the app factory `app` once in a process started as the workers are (a fresh
    interpreter, this environment), and stop with its error if it cannot: uvicorn's supervisor
    replaces a worker that dies while it starts, forever, so a broken install (a package the
    app needs missing) otherwise serves nothing and says so only in a log of tracebacks."""
    module, factory = app.split(":")
    code = f"import importlib; importlib.import_module({module!r}).{factory}()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        raise SystemExit(f"the API cannot start: {lines[-1]}")
