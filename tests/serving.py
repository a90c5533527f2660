"""A real `replay-audit serve` process in a test: a free port, and waiting for it to answer."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(
    base: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60
) -> None:
    """Until `GET {base}/healthz` answers 200; fails with the server's log if the process exits
    or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
