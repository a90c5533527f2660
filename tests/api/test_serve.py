"""`replay-audit serve` on a fresh machine: SQLite under ./var/, migrations, a first admin key
printed once. Run as a real subprocess."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.factories import make_trace

KEY = re.compile(r"\bra_[0-9a-f]{12}_[A-Za-z0-9_-]{43}\b")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(cwd: Path, port: int) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_AUDIT_")}
    # The installed console script, as a user runs it.
    script = Path(sys.executable).with_name("replay-audit")
    return subprocess.Popen(
        [str(script), "serve", "--port", str(port), "--log-level", "warning"],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _wait_healthy(port: int, proc: subprocess.Popen[str], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("serve did not become healthy")


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


@pytest.mark.slow
def test_first_start_prints_an_admin_key_once(tmp_path: Path) -> None:
    port = _free_port()
    proc = _start(tmp_path, port)
    try:
        _wait_healthy(port, proc)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/docs").status_code == 200
    finally:
        first_output = _stop(proc)
    keys = KEY.findall(first_output)
    assert len(keys) == 1, first_output
    assert (tmp_path / "var" / "replay-audit.db").is_file()

    # Second start on the same database: no new key printed, the first one still works.
    proc = _start(tmp_path, port)
    try:
        _wait_healthy(port, proc)
        h = {"X-API-Key": keys[0]}
        created = httpx.post(f"http://127.0.0.1:{port}/v1/traces", json=make_trace(), headers=h)
        assert created.status_code == 201
    finally:
        second_output = _stop(proc)
    assert KEY.findall(second_output) == []
