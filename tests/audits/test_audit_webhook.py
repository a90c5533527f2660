"""Drift alerts POSTed to a real HTTP server on 127.0.0.1: retried with backoff by the runner,
every attempt recorded (its status code and error class, never the receiver's answer), signed
with the schedule's secret, never holding up the audit itself; internal destinations refused
unless the operator's allowlist names them (these tests name 127.0.0.1 in it: their listener
is local).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from replay_audit.audits import tasks
from replay_audit.audits.metrics import Flag
from replay_audit.audits.models import AuditAlert, AuditRun
from replay_audit.audits.tasks import DeliveryFailed, deliver_alert, run_tick
from replay_audit.config import Settings
from replay_audit.db.unit_of_work import session_scope
from replay_audit.queue.runner import InProcessRunner
from replay_audit.ui import session as ui_session
from tests.audits.conftest import (
    PROMPTS,
    HoldingRunner,
    RecordingRunner,
    add_old_shape_history,
    ingest,
    schedule_body,
)

MakeSchedule = Callable[..., tuple[str, dict[str, str]]]

#: What the receiver puts in its error answers: it must never be stored or shown.
RECEIVER_SECRET = "receiver-internal-detail-5f3a"
SESSION_SECRET = "webhook-tests-session-secret-0123456789"
#: The operator's allowlist of these tests: the local listener.
ALLOWED = ["127.0.0.1"]


def verify_signature(secret: str, header: str, body: bytes, tolerance_s: int = 300) -> bool:
    """What a receiver runs (the snippet of docs/audits.md): HMAC-SHA256 over `<t>.<body>`."""
    fields = dict(part.split("=", 1) for part in header.split(","))
    t, v1 = fields["t"], fields["v1"]
    if abs(time.time() - int(t)) > tolerance_s:
        return False
    expected = hmac.new(secret.encode(), t.encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, v1)


class Hook:
    """A webhook receiver: answers with `statuses` in turn (the last one repeats), records each
    request; `hold` (an Event) keeps the first answer back until set."""

    def __init__(
        self,
        statuses: list[int],
        hold: threading.Event | None = None,
        delay_s: float = 0,
        answer: bytes = b"{}",
    ):
        self.statuses = statuses
        self.answer = answer
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
                    hook.requests.append(
                        {"headers": dict(self.headers), "json": json.loads(body), "raw": body}
                    )
                if n == 0 and hook.hold is not None:
                    hook.hold.wait(10)
                if hook.delay_s:
                    threading.Event().wait(hook.delay_s)
                status = hook.statuses[min(n, len(hook.statuses) - 1)]
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(hook.answer)))
                    self.end_headers()
                    self.wfile.write(hook.answer)
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
def settings(make_settings: Callable[..., Settings]) -> Settings:
    """The app's settings: the operator allowlists the local listener."""
    return make_settings(webhook_allowed_hosts=ALLOWED, session_secret=SESSION_SECRET)


@pytest.fixture
def webhook_settings(
    monkeypatch: pytest.MonkeyPatch, make_settings: Callable[..., Settings], worker_env: Any
) -> Iterator[Settings]:
    """Short backoff and timeout and the allowlist, for the tick here and for the job (which
    reads the env)."""
    monkeypatch.setenv("REPLAY_AUDIT_WEBHOOK_RETRY_INTERVALS_S", "[1, 1, 1]")
    monkeypatch.setenv("REPLAY_AUDIT_WEBHOOK_TIMEOUT_S", "1.0")
    monkeypatch.setenv("REPLAY_AUDIT_WEBHOOK_ALLOWED_HOSTS", ",".join(ALLOWED))
    yield make_settings(
        webhook_retry_intervals_s=[1, 1, 1], webhook_timeout_s=1.0, webhook_allowed_hosts=ALLOWED
    )


def _flagged_run(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    url: str,
) -> str:
    """A finished replay run of a schedule whose history makes it drift (see test_audit_api);
    the schedule's id."""
    sid, h = make_schedule(webhook_url=url, sample_size=12)
    add_old_shape_history(db_url, sid, nights=3, n=40)
    ingest(client, h, [logged_trace(p) for p in PROMPTS[:12]])
    assert client.post(f"/v1/audits/schedules/{sid}/runs", headers=h).status_code == 201
    runner.run_all()
    return sid


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
    assert [a["status_code"] for a in alert.attempt_log] == [500, 502, 204]
    assert [a["error"] for a in alert.attempt_log] == ["http_5xx", "http_5xx", None]
    assert alert.last_error == "http_5xx"
    # Three POSTs of the same JSON body, each naming the alert (receivers deduplicate on it).
    assert len(hook.requests) == 3
    assert {r["headers"]["X-Replay-Audit-Alert"] for r in hook.requests} == {alert.public_id}
    assert all(r["json"] == hook.requests[0]["json"] for r in hook.requests)
    body = hook.requests[0]["json"]
    assert body["event"] == "replay_audit.audit.drift" and body["project"] == "acme"
    assert {f["kind"] for f in body["flags"]} >= {"ear_drop", "new_category"}
    assert body["audit_run"]["id"] == run.public_id and body["metrics"]["ear"] < 1
    # Each flag is the typed Flag whole: it says which comparison and why, in numbers.
    assert [Flag.model_validate(f) for f in body["flags"]] == run.flags
    [drop] = [f for f in body["flags"] if f["kind"] == "ear_drop"]
    assert drop["comparison"] == 0 and drop["label"] == "FP16"
    assert drop["test"]["test"] == "fisher_exact_less"
    assert (drop["test"]["baseline_successes"], drop["test"]["baseline_n"]) == (120, 120)
    assert drop["test"]["latest_n"] == 12 and drop["test"]["latest_successes"] < 12
    assert drop["test"]["p_value"] <= drop["test"]["alpha"] == 0.01
    assert drop["threshold_points"] == 5 and drop["drop_points"] > 5
    assert "120/120" in drop["message"] and "Fisher" in drop["message"]
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
    assert all(
        not a["ok"] and a["status_code"] == 503 and a["error"] == "http_5xx"
        for a in alert.attempt_log
    )
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
    assert not first["ok"] and first["error"] == "timeout" and first["status_code"] is None

    with session_scope(db_url) as s:
        alert = s.scalar(select(AuditAlert))
        assert alert is not None
        alert.url = "http://127.0.0.1:9/nothing-listens-here"
    with pytest.raises(DeliveryFailed):
        deliver_alert(*spec.args)  # type: ignore[arg-type]
    alert = _alert(db_url)
    assert alert.attempts == 2 and alert.attempt_log[-1]["error"] == "connection_refused"
    assert tasks.deliver_alert(10**9) == "gone"  # an alert deleted since: nothing to do


# -- signing -------------------------------------------------------------------------------------


def test_deliveries_are_signed_with_the_secret_shown_once_at_creation(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    webhook_settings: Settings,
    serve_hook: Callable[[Hook], str],
) -> None:
    hook = Hook([500, 204])
    url = serve_hook(hook)
    shown: list[str] = []

    def make_schedule(**overrides: Any) -> tuple[str, dict[str, str]]:
        h = headers("admin")
        r = client.post("/v1/audits/schedules", json=schedule_body(**overrides), headers=h)
        assert r.status_code == 201, r.text
        shown.append(r.json()["webhook_secret"])
        return str(r.json()["id"]), h

    sid = _flagged_run(client, runner, make_schedule, logged_trace, db_url, url)
    [secret] = shown
    assert secret.startswith("whsec_") and len(secret) >= 40
    # Shown once: no later read has it, for any role.
    for role in ("admin", "auditor"):
        h = headers(role)
        for path in (f"/v1/audits/schedules/{sid}", "/v1/audits/schedules"):
            r = client.get(path, headers=h)
            assert r.status_code == 200 and secret not in r.text
            assert "webhook_secret" not in r.text
    patched = client.patch(f"/v1/audits/schedules/{sid}", json={"ear_drop_points": 4}, headers=h)
    assert secret not in patched.text

    alerts = InProcessRunner(retry_scale=0.05)
    run_tick(webhook_settings, runner=runner, alert_runner=alerts)
    assert alerts.join(timeout_s=30)
    assert _alert(db_url).status == "delivered" and len(hook.requests) == 2
    for request in hook.requests:
        header = request["headers"]["X-Replay-Audit-Signature"]
        assert verify_signature(secret, header, request["raw"]), header
        assert not verify_signature(secret + "x", header, request["raw"])
        assert not verify_signature(secret, header, request["raw"] + b" ")
    # Each attempt signs anew (its own timestamp in the signature).
    assert all(r["headers"]["X-Replay-Audit-Signature"].startswith("t=") for r in hook.requests)


def test_rotating_the_secret_shows_the_new_one_once(
    client: TestClient, headers: Callable[..., dict[str, str]]
) -> None:
    h = headers("admin")
    body = schedule_body(webhook_url="https://hooks.example.com/rotate")
    first = client.post("/v1/audits/schedules", json=body, headers=h).json()
    sid, old = first["id"], first["webhook_secret"]
    r = client.patch(f"/v1/audits/schedules/{sid}", json={"rotate_webhook_secret": True}, headers=h)
    assert r.status_code == 200
    new = r.json()["webhook_secret"]
    assert new.startswith("whsec_") and new != old
    assert new not in client.get(f"/v1/audits/schedules/{sid}", headers=h).text
    # A schedule without a webhook has no secret to show.
    bare = client.post("/v1/audits/schedules", json=schedule_body(name="bare"), headers=h).json()
    assert bare["webhook_secret"] is None


# -- destination policy --------------------------------------------------------------------------

INTERNAL_URLS = [
    "http://2130706433/",  # 127.0.0.1 in decimal
    "http://0x7f000001/",  # ... in hex
    "http://0177.0.0.1/",  # ... in octal
    "http://127.1/",
    "http://user:pass@10.0.0.1/",
    "http://169.254.169.254/latest/meta-data/",  # cloud metadata
    "http://[::1]/",
    "http://[::ffff:127.0.0.1]/",  # IPv4-mapped
    "http://[::127.0.0.1]:8080/",  # IPv4-compatible
    "http://[::ffff:0:10.0.0.1]/",  # IPv4-translated
    "http://[64:ff9b::192.168.0.1]/",  # NAT64
    "http://[fe80::1]/",
    "http://192.168.1.10/",
    "http://172.16.0.1/",
    "http://100.64.0.1/",  # carrier-grade NAT
    "http://0.0.0.0/",
    "http://localhost/",
    "http://LOCALHOST./hook",
    "http://app.localhost/",
]


@pytest.mark.parametrize("url", INTERNAL_URLS)
def test_internal_destinations_are_refused_at_creation(
    make_client: Callable[..., TestClient], headers: Callable[..., dict[str, str]], url: str
) -> None:
    plain = make_client()  # no allowlist
    h = headers("admin")
    r = plain.post("/v1/audits/schedules", json=schedule_body(webhook_url=url), headers=h)
    assert r.status_code == 422 and r.json()["field"] == "webhook_url", r.text
    ok = plain.post("/v1/audits/schedules", json=schedule_body(), headers=h)
    sid = ok.json()["id"]
    r = plain.patch(f"/v1/audits/schedules/{sid}", json={"webhook_url": url}, headers=h)
    assert r.status_code == 422 and r.json()["field"] == "webhook_url", r.text


def test_credentials_in_the_url_are_refused_even_when_allowlisted(
    make_client: Callable[..., TestClient], headers: Callable[..., dict[str, str]]
) -> None:
    c = make_client(webhook_allowed_hosts=["10.0.0.0/8"])
    h = headers("admin")
    body = schedule_body(webhook_url="https://user:pass@hooks.example.com/x")
    r = c.post("/v1/audits/schedules", json=body, headers=h)
    assert r.status_code == 422 and r.json()["field"] == "webhook_url"
    body = schedule_body(name="allowlisted", webhook_url="http://10.1.2.3/")
    r = c.post("/v1/audits/schedules", json=body, headers=h)
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    ("allowed", "url"),
    [
        (["127.0.0.1"], "http://2130706433/"),
        (["127.0.0.0/8"], "http://127.0.0.2:8080/hook"),
        (["localhost"], "http://localhost:8080/hook"),
        (["::1"], "http://[::1]/"),
        (["10.0.0.0/8", "hooks.internal"], "http://hooks.internal/x"),
    ],
)
def test_the_operator_allowlist_admits_named_hosts_and_networks(
    make_client: Callable[..., TestClient],
    headers: Callable[..., dict[str, str]],
    allowed: list[str],
    url: str,
) -> None:
    c = make_client(webhook_allowed_hosts=allowed)
    r = c.post("/v1/audits/schedules", json=schedule_body(webhook_url=url), headers=headers())
    assert r.status_code == 201, r.text


def test_public_destinations_are_accepted_without_an_allowlist(
    make_client: Callable[..., TestClient], headers: Callable[..., dict[str, str]]
) -> None:
    c = make_client()
    for i, url in enumerate(["https://hooks.example.com/x", "http://8.8.8.8/hook"]):
        body = schedule_body(name=f"public {i}", webhook_url=url)
        assert c.post("/v1/audits/schedules", json=body, headers=headers()).status_code == 201


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "hooks.example.com"])
def test_delivery_refuses_internal_addresses_after_resolving_them(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    webhook_settings: Settings,
    serve_hook: Callable[[Hook], str],
    monkeypatch: pytest.MonkeyPatch,
    host: str,
) -> None:
    """The check that counts is at delivery, on the addresses the name resolves to then: a
    schedule stored before this policy or before the allowlist changed, a name whose DNS answer
    changed since (rebinding: `hooks.example.com` made to resolve to 127.0.0.1 here)."""
    hook = Hook([204])
    url = serve_hook(hook)
    _flagged_run(client, runner, make_schedule, logged_trace, db_url, url)
    recorder = RecordingRunner()
    run_tick(webhook_settings, runner=runner, alert_runner=recorder)
    [spec] = recorder.specs
    port = url.split(":")[2].split("/")[0]
    with session_scope(db_url) as s:
        alert = s.scalar(select(AuditAlert))
        assert alert is not None
        alert.url = f"http://{host}:{port}/hooks/replay-audit"
    real = socket.getaddrinfo

    def rebinding(name: Any, *args: Any, **kwargs: Any) -> Any:
        return real("127.0.0.1" if name == "hooks.example.com" else name, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setenv("REPLAY_AUDIT_WEBHOOK_ALLOWED_HOSTS", "")  # the operator allows none
    with pytest.raises(DeliveryFailed):
        deliver_alert(*spec.args)  # type: ignore[arg-type]
    assert hook.requests == []  # nothing reached the listener
    alert = _alert(db_url)
    assert alert.attempt_log[-1]["error"] == "refused_destination"
    assert alert.attempt_log[-1]["status_code"] is None
    assert alert.last_error == "refused_destination"

    # Named in the allowlist, the same destination is delivered to.
    monkeypatch.setenv("REPLAY_AUDIT_WEBHOOK_ALLOWED_HOSTS", host)
    assert deliver_alert(*spec.args) == "delivered"  # type: ignore[arg-type]
    assert len(hook.requests) == 1


def test_only_the_status_code_and_an_error_class_are_stored(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    webhook_settings: Settings,
    serve_hook: Callable[[Hook], str],
    headers: Callable[..., dict[str, str]],
) -> None:
    answer = json.dumps({"error": f"db password is {RECEIVER_SECRET}"}).encode()
    hook = Hook([500, 404], answer=answer)
    sid = _flagged_run(client, runner, make_schedule, logged_trace, db_url, serve_hook(hook))
    alerts = InProcessRunner(retry_scale=0.05)
    run_tick(webhook_settings, runner=runner, alert_runner=alerts)
    assert alerts.join(timeout_s=30)
    alert = _alert(db_url)
    assert alert.status == "failed" and len(hook.requests) == 4
    assert [(a["status_code"], a["error"]) for a in alert.attempt_log] == [
        (500, "http_5xx"),
        (404, "http_4xx"),
        (404, "http_4xx"),
        (404, "http_4xx"),
    ]
    assert all(set(a) == {"at", "ok", "status_code", "error"} for a in alert.attempt_log)
    assert alert.last_error == "http_4xx"
    # Nothing of the answer anywhere an auditor looks.
    auditor = headers("auditor")
    listed = client.get(f"/v1/audits/schedules/{sid}/alerts", headers=auditor)
    assert listed.status_code == 200 and listed.json()["items"][0]["last_error"] == "http_4xx"
    assert RECEIVER_SECRET not in listed.text
    _sign_in_auditor(client, headers)
    page = client.get(f"/ui/schedules/{sid}")
    assert page.status_code == 200 and "http_4xx" in page.text
    assert RECEIVER_SECRET not in page.text


def _sign_in_auditor(client: TestClient, headers: Callable[..., dict[str, str]]) -> None:
    """Sign the client in to the UI with an auditor key (the cookie stays in its jar)."""
    page = client.get("/ui/sign-in")
    token = page.text.split('name="form_token" value="')[1].split('"')[0]
    r = client.post(
        "/ui/sign-in",
        data={"api_key": headers("auditor")["X-API-Key"], "form_token": token},
        follow_redirects=False,
    )
    assert r.status_code == 303 and ui_session.COOKIE_NAME in client.cookies, r.text


def test_drift_alerts_deliveries_and_each_schedules_last_run_are_in_the_metrics(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    webhook_settings: Settings,
    serve_hook: Callable[[Hook], str],
) -> None:
    from tests.telemetry.scrape import samples, value

    before = samples(client.get("/metrics").text)
    sid = _flagged_run(
        client, runner, make_schedule, logged_trace, db_url, serve_hook(Hook([500, 204]))
    )
    alerts = InProcessRunner(retry_scale=0.05)
    assert run_tick(webhook_settings, runner=runner, alert_runner=alerts).flagged == 1
    assert alerts.join(timeout_s=30)
    text = client.get("/metrics").text
    after = samples(text)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("replay_audit_drift_alerts_total") == 1
    assert moved("replay_audit_webhook_deliveries_total", outcome="http_5xx") == 1
    assert moved("replay_audit_webhook_deliveries_total", outcome="delivered") == 1
    with session_scope(db_url) as s:
        run = s.scalar(select(AuditRun).where(AuditRun.trigger == "manual"))
        assert run is not None
        due = run.due_at.replace(tzinfo=UTC) if run.due_at.tzinfo is None else run.due_at
    last = "replay_audit_audit_last_run_timestamp_seconds"
    assert value(after, last, schedule=sid) == due.timestamp()
    assert "acme" not in text  # the schedule by its id, never the project's name
