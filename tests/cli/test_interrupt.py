"""Ctrl-C (and SIGTERM) while replay jobs run: the process stops its worker threads, exits within
seconds with 130 (143 for SIGTERM) or 0, and prints no traceback and no libstdc++ "terminate
called without an active exception" (a daemon thread still inside torch at interpreter exit).
The demo prints the admin key it created at once, so an interrupted demo does not lock the user
out. Real processes, the embedded default, the bundled model."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
from sqlalchemy import select

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.db.engine import dispose_engines
from replay_audit.db.unit_of_work import session_scope
from replay_audit.engine.hashing import weights_sha256
from replay_audit.replays.models import ReplayJob
from tests.cli.conftest import assert_no_traceback, cli_args, cli_env
from tests.factories import make_config, make_trace

pytestmark = pytest.mark.slow

KEY = re.compile(r"\bra_[0-9a-f]{12}_[A-Za-z0-9_-]{43}\b")
#: Seconds a stopping process may take: the runner finishes the trace it is replaying.
STOP_WITHIN_S = 20


class Output:
    """Lines of a child's stream, read by a thread as they come."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, proc: subprocess.Popen[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.text):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} (exit {proc.poll()}):\n{self.text[-3000:]}")
            time.sleep(0.1)

    def close(self) -> None:
        self._thread.join(timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(args: list[str], cwd: Path) -> tuple[subprocess.Popen[str], Output, Output]:
    proc = subprocess.Popen(
        cli_args(*args), cwd=cwd, env=cli_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    return proc, Output(proc.stdout), Output(proc.stderr)


def _interrupt(proc: subprocess.Popen[str], sig: int) -> int:
    """Send `sig`; the exit code, once the process ended (killed after STOP_WITHIN_S)."""
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"still running {STOP_WITHIN_S} s after signal {sig}") from None


def _wait_healthy(base: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"serve did not become healthy (exit {proc.poll()})")


def _bundled_model_traces(n: int) -> list[dict[str, object]]:
    sha = weights_sha256(BUNDLED_MODEL_DIR)
    config = make_config(device="cpu", gpu=None)
    model = {"name": "tiny-llama", "weights_sha256": sha, "vocab_size": 4096}
    return [
        make_trace(n_prompt=16, n_output=64, vocab=4096, top_k=None, config=config, model=model)
        for _ in range(n)
    ]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_stops_cleanly_mid_replay(sig: int, tmp_path: Path) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc, out, err = _start(["serve", "--port", str(port), "--log-level", "warning"], tmp_path)
    try:
        out.wait_for(KEY.pattern, proc, 120)
        (key,) = KEY.findall(out.text)
        h = {"X-API-Key": key}
        _wait_healthy(base, proc)
        r = httpx.post(f"{base}/v1/traces:batch", json={"traces": _bundled_model_traces(24)},
                       headers=h, timeout=60)  # fmt: skip
        assert r.status_code == 207, r.text
        ids = [item["id"] for item in r.json()["results"]]
        targets = [{"dtype": "fp16"}, {"dtype": "fp16", "intervention": {"kind": "C"}}]
        r = httpx.post(f"{base}/v1/replays", json={"trace_ids": ids, "targets": targets},
                       headers=h, timeout=60)  # fmt: skip
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        deadline = time.monotonic() + 120
        while True:  # until the runner thread is inside a replay
            run = _get(f"{base}/v1/replays/{run_id}", h)
            if run["progress"]["done"] + run["progress"]["failed"] > 0:
                break
            assert time.monotonic() < deadline, run
            time.sleep(0.1)
        assert run["status"] == "running", "the replay should still be running"
        code = _interrupt(proc, sig)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
    assert code in (0, 128 + sig), f"exit {code}\n{err.text[-3000:]}"
    assert_no_traceback(None, out.text + err.text)
    # The job stopped between two traces and went back to the queue (a Ctrl-C is no crash);
    # it was not left "running" for the reconciler to presume dead a quarter of an hour later,
    # nor leased (`db.job_row.leased`), which would keep the next start off it for a minute.
    with session_scope(f"sqlite:///{tmp_path / 'var' / 'replay-audit.db'}") as s:
        jobs = s.scalars(select(ReplayJob)).all()
        assert {j.status for j in jobs} <= {"queued", "done"} and jobs, [j.status for j in jobs]
        assert all(j.attempts == 0 for j in jobs if j.status == "queued")
        assert all(j.lease_until is None for j in jobs), [j.lease_until for j in jobs]
    dispose_engines()
    if sig == signal.SIGINT:  # the next start finishes the run
        proc, out, err = _start(["serve", "--port", str(port), "--log-level", "warning"], tmp_path)
        try:
            _wait_healthy(base, proc)
            deadline = time.monotonic() + 240
            while (run := _get(f"{base}/v1/replays/{run_id}", h))["status"] != "done":
                assert time.monotonic() < deadline, run
                time.sleep(0.5)
            # 24 traces x (2 targets + the reproduction check the run adds)
            assert run["progress"]["done"] == 72, run
            _interrupt(proc, signal.SIGTERM)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
            err.close()


def _get(url: str, headers: dict[str, str]) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(url, headers=headers, timeout=10).json()
    return body


def test_interrupted_demo_has_printed_its_key(tmp_path: Path) -> None:
    proc, out, err = _start(["demo", "--prompts", "12", "--max-new-tokens", "48"], tmp_path)
    try:
        out.wait_for(r"ingested \d+ traces", proc, 300)
        printed_before = KEY.findall(out.text)
        time.sleep(1.0)  # the replay runs
        code = _interrupt(proc, signal.SIGINT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
    assert len(printed_before) == 1, f"the key must be printed before the replays:\n{out.text}"
    assert code in (0, 130), f"exit {code}\n{err.text[-3000:]}"
    assert_no_traceback(None, out.text + err.text)
