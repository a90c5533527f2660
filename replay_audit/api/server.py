"""Serving the app with several processes, with the latency of one.

uvicorn's multi-process mode binds its listening socket as `socket.socket(AF_INET)`, whose
`proto` is 0. asyncio turns Nagle's algorithm off (TCP_NODELAY) only on accepted sockets whose
`proto` is IPPROTO_TCP, so with `--workers 2` every response went out under Nagle and met the
client's delayed ACK: single-POST p50 52 ms against 9 ms with one process (issue 10, defect 12).
Binding the socket with IPPROTO_TCP gives the accepted connections the protocol asyncio
expects, and they get TCP_NODELAY like the single-process server's.
"""

from __future__ import annotations

import socket

import uvicorn
from uvicorn.supervisors import Multiprocess


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


def run_processes(app: str, *, host: str, port: int, workers: int, log_level: str) -> None:
    """Serve the app factory `app` ("module:function") from `workers` processes."""
    config = TcpConfig(
        app, factory=True, host=host, port=port, workers=workers, log_level=log_level
    )
    sock = config.bind_socket()
    # The children get the socket pickled (multiprocessing keeps its family, type and proto).
    Multiprocess(config, sockets=[sock]).run()
