"""The nightly audit rule of issue 23: a schedule that verifies its samples flags a group that
turns inconsistent, through the alert path every audit flag takes (the webhook, the API, the
schedule page). On the bundled checkpoint with the real engine, on SQLite and PostgreSQL: a
provider serving it honestly (BF16) raises no such flag; once the provider's traces come from a
4-bit RTN copy that claims to be it, the next run flags the group, the signed webhook carries
the flag with the verdict's figures, and a third run, still inconsistent, does not flag it
again."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from replay_audit.audits.metrics import Flag
from replay_audit.audits.models import AuditAlert
from replay_audit.audits.tasks import TickReport, deliver_alert, run_tick
from replay_audit.config import Settings
from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope
from tests.audits.conftest import RecordingRunner, schedule_body, set_created_at
from tests.audits.test_audit_webhook import ALLOWED, Hook, verify_signature
from tests.audits.test_audit_webhook import serve_hook as serve_hook
from tests.replays.conftest import HoldingRunner
from tests.ui.conftest import SESSION_SECRET
from tests.ui.conftest import ui_client as ui_client
from tests.verifications.conftest import LOGGED_PROMPTS, store

#: The group of provider-x's traces: their tags, and the configuration they claim.
GROUP = "production,provider-x · bf16 / head bf16 / sdpa"


@pytest.fixture
def settings(make_settings: Callable[..., Settings], tmp_path: Path) -> Settings:
    """The app's: the webhook's local listener allowed, a session secret for the page."""
    return make_settings(
        webhook_allowed_hosts=ALLOWED,
        session_secret=SESSION_SECRET,
        session_secret_file=tmp_path / "session-secret",
    )


@pytest.fixture
def deliveries(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingRunner]:
    """Alert deliveries held for the test to run; the delivery job reads the allowlist from
    the environment, as a worker does."""
    monkeypatch.setenv("REPLAY_AUDIT_WEBHOOK_ALLOWED_HOSTS", ",".join(ALLOWED))
    monkeypatch.setenv("REPLAY_AUDIT_WEBHOOK_RETRY_INTERVALS_S", "[1]")
    yield RecordingRunner()


def _night(
    client: TestClient,
    admin: dict[str, str],
    sid: str,
    jobs: HoldingRunner,
    tick: Callable[[], TickReport],
) -> dict[str, Any]:
    """Run the schedule now, run its jobs (the replay run and the verification), tick: the
    evaluated run as the API shows it. Each night starts in a whole second of its own: run-now
    rounds "now" up to the second, and two calls within one second are one run."""
    time.sleep(1.001 - time.time() % 1.0)
    r = client.post(f"/v1/audits/schedules/{sid}/runs", headers=admin)
    assert r.status_code == 201, r.text
    run = r.json()["run"]
    assert run["verification_id"] and run["verification_status"] == "queued", run
    assert run["replay_run_id"] and run["n_sampled"] == LOGGED_PROMPTS
    assert jobs.run_all() == 2  # the replay job and the verification job
    report = tick()
    assert (report.evaluated, report.errors) == (1, 0), report.summary()
    runs = client.get(f"/v1/audits/schedules/{sid}/runs", headers=admin).json()["items"]
    got = next(x for x in runs if x["id"] == run["id"])
    assert got["status"] == "done" and got["verification_status"] == "done", got
    assert got["verification_id"] == run["verification_id"]
    return dict(got)


def _group_flags(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in run["flags"] if f["kind"] == "group_inconsistent"]


@pytest.mark.slow
def test_a_group_that_turns_inconsistent_is_flagged_and_alerted_once(
    client: TestClient,
    job_runner: HoldingRunner,
    null_claims: list[dict[str, Any]],
    logged: dict[str, list[dict[str, Any]]],
    headers: Callable[..., dict[str, str]],
    settings: Settings,
    deliveries: RecordingRunner,
    serve_hook: Callable[[Hook], str],
    ui_client: Callable[..., TestClient],
    db_url: str,
) -> None:
    hook = Hook([204])
    admin = headers("admin")
    body = schedule_body(
        name="provider audit",
        sample_size=50,
        replay={"compare_with": "self"},
        verify={"group_by": "tag"},
        webhook_url=serve_hook(hook),
    )
    r = client.post("/v1/audits/schedules", json=body, headers=admin)
    assert r.status_code == 201, r.text
    sid, secret = r.json()["id"], r.json()["webhook_secret"]
    assert r.json()["verify"] == {"group_by": "tag", "false_alarm_rate": 0.01, "device": None}

    def tick() -> TickReport:
        return run_tick(settings, runner=job_runner, alert_runner=deliveries)

    # Night 1: provider-x serves the checkpoint it claims (BF16, honest).
    honest = store(client, admin, logged["bf16"], "production", "provider-x", prefix="n1")
    first = _night(client, admin, sid, job_runner, tick)
    assert first["flags"] == []  # an honest night raises no flag at all
    [point] = client.get(f"/v1/audits/schedules/{sid}/trend", headers=admin).json()["points"]
    verification = point["verification"]
    assert verification["id"] == first["verification_id"] and verification["status"] == "done"
    assert [(g["group"], g["verdict"]) for g in verification["groups"]] == [(GROUP, "consistent")]
    assert deliveries.specs == [] and len(null_claims) == 1  # the null, measured once

    # Night 2: the same provider's traces now come from a 4-bit RTN copy claiming the same
    # checkpoint; the honest ones are out of the window.
    set_created_at(db_url, honest, utcnow() - timedelta(days=3))
    store(client, admin, logged["rtn4"], "production", "provider-x", prefix="n2")
    second = _night(client, admin, sid, job_runner, tick)
    # (The self-replay disagrees too: the schedule's replay flags the night its own way.)
    assert {f["kind"] for f in second["flags"]} >= {"self_disagreement", "group_inconsistent"}
    [flag] = _group_flags(second)
    assert flag["group"] == flag["label"] == GROUP and flag["comparison"] is None
    assert flag["previous_verdict"] == "consistent"
    assert flag["verdict"]["verdict"] == "inconsistent"
    assert flag["verdict"]["score"] > flag["verdict"]["threshold"]
    assert flag["verdict"]["false_alarm_rate"] == 0.01 and flag["verdict"]["tokens"] > 0
    assert "inconsistent with the claimed checkpoint" in flag["message"]
    assert "consistent in the previous verified run" in flag["message"]

    # The alert: one delivery, signed, carrying the flag whole and the verification.
    [spec] = deliveries.specs
    assert deliver_alert(*spec.args) == "delivered"  # type: ignore[arg-type]
    [request] = hook.requests
    payload = request["json"]
    assert verify_signature(secret, request["headers"]["X-Replay-Audit-Signature"], request["raw"])
    assert payload["audit_run"]["id"] == second["id"]
    assert payload["audit_run"]["verification_id"] == second["verification_id"]
    [sent] = [f for f in payload["flags"] if f["kind"] == "group_inconsistent"]
    assert Flag.model_validate(sent) == Flag.model_validate(flag)
    assert payload["verification"]["verdict"] == "inconsistent"
    with session_scope(db_url) as s:
        alert = s.scalar(select(AuditAlert))
        assert alert is not None and alert.status == "delivered"
    alerts = client.get(f"/v1/audits/schedules/{sid}/alerts", headers=admin).json()["items"]
    assert [a["audit_run_id"] for a in alerts] == [second["id"]]

    # Night 3: still inconsistent, so not "turned": no second flag for the group.
    third = _night(client, admin, sid, job_runner, tick)
    assert _group_flags(third) == [], third["flags"]
    points = client.get(f"/v1/audits/schedules/{sid}/trend", headers=admin).json()["points"]
    assert [p["verification"]["groups"][0]["verdict"] for p in points] == [
        "consistent",
        "inconsistent",
        "inconsistent",
    ]
    assert len(null_claims) == 1

    # The schedule page shows the rule, each run's verdicts (linked) and the flag with why.
    page = ui_client("auditor").get(f"/ui/schedules/{sid}")
    assert page.status_code == 200, page.text
    assert 'id="schedule-verify"' in page.text and "turns inconsistent" in page.text
    assert f"/verifications/{second['verification_id']}" in page.text
    assert "group inconsistent" in page.text and "false-alarm rate 0.01" in page.text
