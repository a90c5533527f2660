"""Drift alerts POSTed to a real HTTP server on 127.0.0.1: retried with backoff by the runner,
every attempt recorded, and never holding up the audit itself."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from replay_audit.audits import tasks
from replay_audit.audits.models import AuditAlert, AuditRun, AuditSchedule
from replay_audit.audits.tasks import DeliveryFailed, deliver_alert, run_tick
from replay_audit.config import Settings
from replay_audit.db.unit_of_work import session_scope
from replay_audit.queue.runner import InProcessRunner
from tests.audits.conftest import PROMPTS, HoldingRunner, RecordingRunner, ingest, utc

MakeSchedule = Callable[..., tuple[str, dict[str, str]]]


class Hook:
    """A webhook receiver: answers with `statuses` in turn (the last one repeats), records each
    request; `hold` (an Event) keeps the first answer back until set."""

    def __init__(
        self, statuses: list[int], hold: threading.Event | None = None, delay_s: float = 0
    ):
        self.statuses = statuses
        self.hold = hold
        self.delay_s = delay_s
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with hook.lock:
                    n = len(hook.requests)
                    hook.requests.append({"headers": dict(self.headers), "json": json.loads(body)})
                if n == 0 and hook.hold is not None:
                    hook.hold.wait(10)
                if hook.delay_s:
                    threading.Event().wait(hook.delay_s)
                status = hook.statuses[min(n, len(hook.statuses) - 1)]
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (the timeout test)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def serve_hook() -> Iterator[Callable[[Hook], str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(hook: Hook) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), hook.handler())
        server.daemon_threads = True  # a handler still sleeping must not hold up the teardown
        server.block_on_close = False
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/hooks/replay-audit"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def webhook_settings(
    monkeypatch: pytest.MonkeyPatch, make_settings: Callable[..., Settings], worker_env: Any
) -> Settings:
    """Short backoff and timeout, for the tick here and for the job (which reads the env)."""
    monkeypatch.setenv("REPLAY_AUDIT_WEBHOOK_RETRY_INTERVALS_S", "[1, 1, 1]")
    monkeypatch.setenv("REPLAY_AUDIT_WEBHOOK_TIMEOUT_S", "1.0")
    return make_settings(webhook_retry_intervals_s=[1, 1, 1], webhook_timeout_s=1.0)


def _flagged_run(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    url: str,
) -> None:
    """A finished replay run of a schedule whose history makes it drift (see test_audit_api)."""
    sid, h = make_schedule(webhook_url=url)
    perfect = {
        "comparisons": [
            {"index": i, "self": i == 2, "ear": 1.0, "categories": {"agreed": 8}} for i in range(3)
        ]
    }
    with session_scope(db_url) as s:
        schedule = s.scalar(select(AuditSchedule).where(AuditSchedule.public_id == sid))
        assert schedule is not None
        for night in (1, 2, 3):
            s.add(
                AuditRun(
                    public_id=f"ar_h{night}",
                    schedule_id=schedule.id,
                    due_at=utc(2026, 1, night, 2),
                    trigger="scheduled",
                    status="done",
                    window_start=utc(2026, 1, night),
                    window_end=utc(2026, 1, night, 2),
                    metrics=perfect,
                    flags=[],
                )
            )
    ingest(client, h, [logged_trace(p) for p in PROMPTS[:12]])
    assert client.post(f"/v1/audits/schedules/{sid}/runs", headers=h).status_code == 201
    runner.run_all()


def _alert(db_url: str) -> AuditAlert:
    with session_scope(db_url) as s:
        alert = s.scalar(select(AuditAlert))
        assert alert is not None
        return alert


def test_fails_twice_then_delivered_without_blocking_the_audit(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    webhook_settings: Settings,
    serve_hook: Callable[[Hook], str],
) -> None:
    hold = threading.Event()
    hook = Hook([500, 502, 204], hold=hold)
    url = serve_hook(hook)
    _flagged_run(client, runner, make_schedule, logged_trace, db_url, url)
    alerts = InProcessRunner(retry_scale=0.05)  # backoff 1 s -> 50 ms

    report = run_tick(webhook_settings, runner=runner, alert_runner=alerts)
    # The tick is back, the run evaluated and committed, while the webhook still holds its
    # first answer: the audit does not wait for the receiver.
    assert (report.evaluated, report.flagged, report.errors) == (1, 1, 0)
    with session_scope(db_url) as s:
        run = s.scalar(select(AuditRun).where(AuditRun.trigger == "manual"))
        assert run is not None and run.status == "done" and run.flags
    assert _alert(db_url).status == "pending"
    hold.set()
    assert alerts.join(timeout_s=30)

    alert = _alert(db_url)
    assert alert.status == "delivered" and alert.delivered_at is not None
    assert alert.attempts == 3
    assert [a["ok"] for a in alert.attempt_log] == [False, False, True]
    assert alert.attempt_log[0]["error"].startswith("HTTP 500")
    assert alert.attempt_log[1]["error"].startswith("HTTP 502")
    assert alert.last_error is not None and alert.last_error.startswith("HTTP 502")
    # Three POSTs of the same JSON body, each naming the alert (receivers deduplicate on it).
    assert len(hook.requests) == 3
    assert {r["headers"]["X-Replay-Audit-Alert"] for r in hook.requests} == {alert.public_id}
    assert all(r["json"] == hook.requests[0]["json"] for r in hook.requests)
    body = hook.requests[0]["json"]
    assert body["event"] == "replay_audit.audit.drift" and body["project"] == "acme"
    assert {f["kind"] for f in body["flags"]} >= {"ear_drop", "new_category"}
    assert body["audit_run"]["id"] == run.public_id and body["metrics"]["ear"] < 1
    # Delivered: later ticks leave it alone.
    assert run_tick(webhook_settings, runner=runner, alert_runner=alerts).alerts_enqueued == 0


def test_gives_up_after_the_last_retry_and_records_why(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    webhook_settings: Settings,
    serve_hook: Callable[[Hook], str],
) -> None:
    hook = Hook([503])
    _flagged_run(client, runner, make_schedule, logged_trace, db_url, serve_hook(hook))
    alerts = InProcessRunner(retry_scale=0.05)
    run_tick(webhook_settings, runner=runner, alert_runner=alerts)
    assert alerts.join(timeout_s=30)
    alert = _alert(db_url)
    assert alert.status == "failed" and alert.attempts == 4 == len(hook.requests)  # 1 + 3 retries
    assert all(not a["ok"] and a["error"].startswith("HTTP 503") for a in alert.attempt_log)
    assert run_tick(webhook_settings, runner=runner, alert_runner=alerts).alerts_enqueued == 0
    with session_scope(db_url) as s:
        run = s.scalar(select(AuditRun).where(AuditRun.trigger == "manual"))
        assert run is not None and run.status == "done"  # the audit stands


def test_timeouts_and_refused_connections_are_recorded(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    webhook_settings: Settings,
    serve_hook: Callable[[Hook], str],
) -> None:
    slow = Hook([200], delay_s=2.0)  # longer than the 1 s timeout
    _flagged_run(client, runner, make_schedule, logged_trace, db_url, serve_hook(slow))
    recorder = RecordingRunner()
    run_tick(webhook_settings, runner=runner, alert_runner=recorder)
    [spec] = recorder.specs
    assert spec.retry_intervals_s == (1, 1, 1) and spec.timeout_s >= 1
    with pytest.raises(DeliveryFailed):
        deliver_alert(*spec.args)  # type: ignore[arg-type]
    first = _alert(db_url).attempt_log[-1]
    assert not first["ok"] and "Timeout" in first["error"]

    with session_scope(db_url) as s:
        alert = s.scalar(select(AuditAlert))
        assert alert is not None
        alert.url = "http://127.0.0.1:9/nothing-listens-here"
    with pytest.raises(DeliveryFailed):
        deliver_alert(*spec.args)  # type: ignore[arg-type]
    alert = _alert(db_url)
    assert alert.attempts == 2 and "Connect" in alert.attempt_log[-1]["error"]
    assert tasks.deliver_alert(10**9) == "gone"  # an alert deleted since: nothing to do
