"""Audit schedules over HTTP with fake engines, on SQLite and PostgreSQL: the contract, roles
and project isolation, runs as ordinary replay runs, ticks at frozen instants, empty windows,
missed runs and catch-up, pause/resume/delete, the trend and drift flags."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from replay_audit.audits.models import AuditRun, AuditSchedule
from replay_audit.audits.service import idempotency_key
from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope
from replay_audit.replays.models import ReplayRun
from tests.audits.conftest import (
    OLD_SHAPE_FLAG,
    PROMPTS,
    HoldingRunner,
    RecordingRunner,
    add_old_shape_history,
    ingest,
    schedule_body,
    set_active_since,
    set_created_at,
    utc,
)

Headers = Callable[..., dict[str, str]]
MakeSchedule = Callable[..., tuple[str, dict[str, str]]]


def _count(db_url: str, model: Any) -> int:
    with session_scope(db_url) as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def test_create_read_and_roles(client: TestClient, headers: Headers) -> None:
    admin = headers("admin")
    body = schedule_body(webhook_url="https://hooks.example.com/secret/T0K3N")
    r = client.post("/v1/audits/schedules", json=body, headers=admin)
    assert r.status_code == 201, r.text
    s = r.json()
    assert s["id"].startswith("as_") and s["project"] == "acme"
    assert s["cron"] == "0 2 * * *"  # nightly by default
    assert s["status"] == "active" and s["missed"] == 0 and s["last_run"] is None
    assert s["next_due_at"].endswith(("02:00:00Z", "02:00:00+00:00"))
    assert s["replay"]["compare_with"] == "self" and len(s["replay"]["targets"]) == 2
    assert s["webhook_url"] == "https://hooks.example.com/secret/T0K3N"

    auditor = headers("auditor")
    seen = client.get(f"/v1/audits/schedules/{s['id']}", headers=auditor).json()
    assert seen["webhook_url"] == "https://hooks.example.com/..."  # the secret path stays hidden
    assert [
        x["id"] for x in client.get("/v1/audits/schedules", headers=auditor).json()["items"]
    ] == [s["id"]]
    assert (
        client.post(
            "/v1/audits/schedules", json=schedule_body(name="x"), headers=auditor
        ).status_code
        == 403
    )
    assert (
        client.patch(
            f"/v1/audits/schedules/{s['id']}", json={"status": "paused"}, headers=auditor
        ).status_code
        == 403
    )
    assert client.post(f"/v1/audits/schedules/{s['id']}/runs", headers=auditor).status_code == 403
    assert client.get("/v1/audits/schedules", headers=headers("submitter")).status_code == 403
    assert client.get("/v1/audits/schedules").status_code == 401

    # Another project sees nothing: 404 on every route, an empty list.
    other = headers("admin", project="globex")
    assert client.get("/v1/audits/schedules", headers=other).json()["items"] == []
    for method, path in [
        ("GET", ""),
        ("PATCH", ""),
        ("DELETE", ""),
        ("POST", "/runs"),
        ("GET", "/runs"),
        ("GET", "/trend"),
        ("GET", "/missed"),
        ("POST", "/catch-up"),
        ("GET", "/alerts"),
    ]:
        kw: dict[str, Any] = {"json": {"status": "paused"}} if method == "PATCH" else {}
        resp = client.request(method, f"/v1/audits/schedules/{s['id']}{path}", headers=other, **kw)
        assert resp.status_code == 404, (method, path, resp.text)
    # Names are unique per project, not globally.
    assert client.post("/v1/audits/schedules", json=body, headers=admin).status_code == 409
    assert client.post("/v1/audits/schedules", json=body, headers=other).status_code == 201


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ({"cron": "0 2 * *"}, "cron"),
        ({"cron": "0 0 30 2 *"}, "cron"),
        ({"replay": {"targets": []}}, "replay"),
        ({"replay": {"targets": [{"dtype": "fp16"}], "pairs": [[0, 1]]}}, "replay"),
        ({"replay": {"targets": [{"dtype": "fp12"}]}}, "replay"),
        ({"policy": "most_interesting"}, "policy"),
        ({"sample_size": 0}, "sample_size"),
        ({"selection": {"window_hours": 0}}, "selection"),
        ({"webhook_url": "ftp://example.com/x"}, "webhook_url"),
        ({"surprise": 1}, "surprise"),
        ({"replay": {"targets": [{"dtype": "fp16"}], "scan_flag_ulps": 5000}}, "scan_flag_ulps"),
        ({"replay": {"targets": [{"dtype": "fp16"}], "scan_flag_ulps": -2}}, "scan_flag_ulps"),
        ({"replay": {"targets": [{"dtype": "fp16"}], "scan_flag_ulps": "many"}}, "scan_flag_ulps"),
        (
            {"replay": {"targets": [{"dtype": "fp16"}], "scan_flag_ulps": "\u0000"}},
            "scan_flag_ulps",
        ),
        ({"replay": {"targets": [{"dtype": "fp16"}], "scan_flag_ulps": 1e308}}, "scan_flag_ulps"),
        ({"replay": {"targets": [{"dtype": "fp16"}], "decode_window": -1}}, "decode_window"),
        (
            {"replay": {"targets": [{"dtype": "fp16"}], "mode": "scan", "decode_window": 8}},
            "decode_window",
        ),
    ],
)
def test_invalid_schedules_are_422(
    client: TestClient, headers: Headers, overrides: dict[str, Any], where: str
) -> None:
    r = client.post("/v1/audits/schedules", json=schedule_body(**overrides), headers=headers())
    assert r.status_code == 422, r.text
    assert where in r.text


def test_cuda_targets_are_refused_by_the_embedded_runner(
    client: TestClient, headers: Headers
) -> None:
    body = schedule_body(replay={"targets": [{"dtype": "bf16", "lm_head_dtype": "fp8_e4m3"}]})
    r = client.post("/v1/audits/schedules", json=body, headers=headers())
    assert r.status_code == 422 and "CUDA" in r.json()["detail"]


def test_run_now_is_an_ordinary_replay_run(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    tick: Callable[..., Any],
) -> None:
    sid, h = make_schedule()
    ingest(client, h, [logged_trace(p) for p in PROMPTS[:12]])
    r = client.post(f"/v1/audits/schedules/{sid}/runs", headers=h)
    assert r.status_code == 201, r.text
    run = r.json()["run"]
    assert run["trigger"] == "manual" and run["status"] == "running"
    assert run["n_candidates"] == 12 and run["n_sampled"] == 8

    replay = client.get(f"/v1/replays/{run['replay_run_id']}", headers=h).json()
    assert replay["schedule_id"] == sid
    assert replay["request"]["idempotency_key"] == f"schedule:{sid}:{run['due_at'][:19]}Z"
    assert replay["n_traces"] == 8 and replay["status"] == "queued"

    assert runner.run_all() == 1
    assert tick().evaluated == 1
    trend = client.get(f"/v1/audits/schedules/{sid}/trend", headers=h).json()
    [point] = trend["points"]
    replay = client.get(f"/v1/replays/{run['replay_run_id']}", headers=h).json()
    fp16, fp16_c, self_ = replay["statistics"]["comparisons"]
    [lift] = [x for x in replay["statistics"]["lifts"] if x["comparison_b"] == 1]
    assert point["status"] == "done" and point["audit_run_id"] == run["id"]
    assert point["date"] == run["due_at"][:10]
    assert point["ear"] == fp16["ear"]["estimate"]
    assert point["c_lift"]["lift"] == lift["lift"] and point["c_lift"]["comparison"] == 1
    assert point["trigger_rate"] == fp16_c["trigger_rate"]
    assert point["self_agreement"] == self_["ear"]["estimate"] == 1.0
    assert point["categories"] == {k: v["successes"] for k, v in fp16["categories"].items()}
    assert sum(point["categories"].values()) == 8
    assert [c["label"] for c in point["comparisons"]] == [
        "FP16",
        "FP16 + C",
        "self (logged configuration)",
    ]
    assert point["flagged"] is False  # no history yet: nothing to drift from, self agrees
    # The schedule shows its last run.
    s = client.get(f"/v1/audits/schedules/{sid}", headers=h).json()
    assert s["last_run"]["id"] == run["id"] and s["last_run"]["status"] == "done"


def test_tick_starts_each_due_time_exactly_once(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    tick: Callable[..., Any],
    db_url: str,
) -> None:
    sid, h = make_schedule()
    set_active_since(db_url, sid, utc(2030, 1, 10))
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:10]])
    set_created_at(db_url, ids, utc(2030, 1, 14, 12))

    first = tick(utc(2030, 1, 15, 1, 59))  # 14 Jan 02:00 is due (empty window)
    assert (first.due, first.started) == (1, 1)
    assert "1 schedule due, 1 run started" in first.summary()
    assert tick(utc(2030, 1, 15, 2, 0, 1)).started == 1  # 15 Jan 02:00: the traces' night
    for later in (utc(2030, 1, 15, 2, 0, 30), utc(2030, 1, 15, 2, 5), utc(2030, 1, 15, 23)):
        quiet = tick(later)
        assert (quiet.due, quiet.started) == (0, 0)
    with session_scope(db_url) as s:
        runs = list(s.scalars(select(AuditRun).order_by(AuditRun.due_at)))
        keys = list(s.scalars(select(ReplayRun.idempotency_key)))
    assert [(r.due_at, r.status, r.trigger) for r in runs] == [
        (utc(2030, 1, 14, 2), "no_traces", "scheduled"),
        (utc(2030, 1, 15, 2), "running", "scheduled"),
    ]
    assert runs[1].window_start == utc(2030, 1, 14, 2) and runs[1].window_end == utc(2030, 1, 15, 2)
    assert keys == [idempotency_key(sid, utc(2030, 1, 15, 2))]
    runner.run_all()
    report = tick(utc(2030, 1, 15, 23, 30))
    assert (report.started, report.evaluated, report.errors) == (0, 1, 0)
    assert tick(utc(2030, 1, 16, 2)).started == 1  # the next night


def test_window_is_relative_to_the_due_time_and_sampling_is_reproducible(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    tick: Callable[..., Any],
    db_url: str,
) -> None:
    a, h = make_schedule(name="a", sample_size=5)
    b, _ = make_schedule(name="b", sample_size=5)  # the same seed and selection
    c, _ = make_schedule(name="c", sample_size=5, seed=8)
    for sid in (a, b, c):
        set_active_since(db_url, sid, utc(2030, 1, 1))
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS])
    set_created_at(db_url, ids[:16], utc(2030, 1, 15, 0))  # in the window of 15 Jan 02:00
    set_created_at(db_url, ids[16:20], utc(2030, 1, 13, 23))  # a night too early
    set_created_at(db_url, ids[20:], utc(2030, 1, 15, 2))  # at the due time: the next window
    assert tick(utc(2030, 1, 15, 2, 0, 10)).started == 3

    def sample(sid: str) -> set[str]:
        [run] = client.get(f"/v1/audits/schedules/{sid}/runs", headers=h).json()["items"]
        assert run["n_candidates"] == 16
        replay = client.get(f"/v1/replays/{run['replay_run_id']}", headers=h).json()
        return set(replay["request"]["trace_ids"])

    assert sample(a) == sample(b)
    assert sample(a) <= set(ids[:16]) and len(sample(a)) == 5
    assert sample(c) != sample(a)


def test_empty_window_is_a_visible_no_traces_run(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    tick: Callable[..., Any],
    db_url: str,
) -> None:
    sid, h = make_schedule(selection={"tags": ["production"], "model_name": "nobody"})
    set_active_since(db_url, sid, utc(2030, 1, 1))
    report = tick(utc(2030, 1, 15, 3))
    assert (report.started, report.errors) == (1, 0)
    assert tick(utc(2030, 1, 15, 4)).started == 0
    [point] = client.get(f"/v1/audits/schedules/{sid}/trend", headers=h).json()["points"]
    assert point["status"] == "no_traces" and point["n_sampled"] == 0
    assert point["ear"] is None and point["replay_run_id"] is None
    assert _count(db_url, ReplayRun) == 0


def test_missed_runs_and_catch_up(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    tick: Callable[..., Any],
    db_url: str,
) -> None:
    # Hourly with one-hour windows, so "the scheduler was down overnight" fits in a test.
    sid, h = make_schedule(cron="0 * * * *", selection={"window_hours": 1})
    hour = utcnow().replace(minute=0, second=0, microsecond=0)  # the newest due time
    set_active_since(db_url, sid, hour - timedelta(hours=4, minutes=1))
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:6]])
    set_created_at(db_url, ids, hour - timedelta(hours=2, minutes=30))  # due hour - 2's window

    assert tick().started == 1  # the scheduler comes back: only the newest hour is started
    missed = client.get(f"/v1/audits/schedules/{sid}/missed", headers=h).json()
    expected = [hour - timedelta(hours=k) for k in (4, 3, 2, 1)]
    assert [datetime.fromisoformat(d) for d in missed["due_at"]] == expected
    assert missed["truncated"] is False
    assert client.get(f"/v1/audits/schedules/{sid}", headers=h).json()["missed"] == 4

    r = client.post(f"/v1/audits/schedules/{sid}/catch-up", json={"limit": 3}, headers=h)
    assert r.status_code == 200, r.text
    started = r.json()["started"]
    assert [x["due_at"] for x in started] == sorted(missed["due_at"][1:], reverse=True)
    assert all(x["trigger"] == "catch_up" for x in started)
    assert r.json()["remaining"] == 1
    # Only the window the traces were logged in has something to replay.
    assert [x["status"] for x in started] == ["no_traces", "running", "no_traces"]
    assert started[1]["n_sampled"] == 6

    r = client.post(f"/v1/audits/schedules/{sid}/catch-up", headers=h)
    assert len(r.json()["started"]) == 1 and r.json()["remaining"] == 0
    assert client.get(f"/v1/audits/schedules/{sid}/missed", headers=h).json()["due_at"] == []
    assert client.post(f"/v1/audits/schedules/{sid}/catch-up", headers=h).json()["started"] == []
    assert _count(db_url, AuditRun) == 5


def test_pause_resume_and_delete(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    tick: Callable[..., Any],
    db_url: str,
) -> None:
    sid, h = make_schedule(cron="* * * * *")
    set_active_since(db_url, sid, utcnow() - timedelta(minutes=30))
    r = client.patch(f"/v1/audits/schedules/{sid}", json={"status": "paused"}, headers=h)
    assert r.status_code == 200 and r.json()["status"] == "paused"
    assert r.json()["next_due_at"] is None
    assert tick().started == 0
    # Missed runs stop counting where the pause began.
    missed_paused = client.get(f"/v1/audits/schedules/{sid}/missed", headers=h).json()["due_at"]
    assert 18 <= len(missed_paused) <= 21

    r = client.patch(
        f"/v1/audits/schedules/{sid}",
        json={"status": "active", "webhook_url": "https://hooks.test/h", "ear_drop_points": 2},
        headers=h,
    )
    s = r.json()
    assert s["status"] == "active" and s["ear_drop_points"] == 2
    assert s["webhook_url"] == "https://hooks.test/h" and s["missed"] == 0  # afresh
    assert s["webhook_secret"].startswith("whsec_")  # a webhook added: its secret, this once
    # Resuming starts afresh: the minute under way when it resumed is before active_since.
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:3]])
    set_created_at(db_url, ids, utcnow() - timedelta(minutes=2))
    r = client.post(f"/v1/audits/schedules/{sid}/runs", headers=h)
    replay_id = r.json()["run"]["replay_run_id"]

    assert client.delete(f"/v1/audits/schedules/{sid}", headers=h).status_code == 204
    assert client.get(f"/v1/audits/schedules/{sid}", headers=h).status_code == 404
    assert _count(db_url, AuditRun) == 0 and _count(db_url, AuditSchedule) == 0
    # Its replay run stays, an ordinary run still tagged with the schedule.
    assert client.get(f"/v1/replays/{replay_id}", headers=h).json()["schedule_id"] == sid


def test_drift_flags_are_stored_and_alerted(
    client: TestClient,
    runner: HoldingRunner,
    alerts: RecordingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    tick: Callable[..., Any],
    headers: Headers,
    db_url: str,
) -> None:
    """Three perfect nights before (120/120 pooled, rows in the old stored shape), then a
    night whose FP16 replay diverges on 12 traces: the EAR falls significantly below the
    baseline and head_reachable is new for the schedule, significantly."""
    sid, h = make_schedule(
        webhook_url="https://hooks.example.com/T0K3N", ear_drop_points=5, sample_size=12
    )
    # Three perfect nights of 40 traces, stored as rows of the release before typed metrics.
    add_old_shape_history(db_url, sid, nights=3, n=40, flag_first=True)
    ingest(client, h, [logged_trace(p) for p in PROMPTS[:12]])
    run = client.post(f"/v1/audits/schedules/{sid}/runs", headers=h).json()["run"]
    runner.run_all()
    report = tick()
    assert (report.evaluated, report.flagged) == (1, 1)

    point = client.get(f"/v1/audits/schedules/{sid}/trend", headers=h).json()["points"][-1]
    assert point["audit_run_id"] == run["id"]
    assert point["ear"] < 0.95, "the fake model must flip some traces in FP16"
    kinds = {(f["kind"], f["comparison"]) for f in point["flags"]}
    assert ("ear_drop", 0) in kinds and ("new_category", 0) in kinds
    assert not any(k == "self_disagreement" for k, _ in kinds)
    assert point["flagged"] is True
    [drop] = [f for f in point["flags"] if f["kind"] == "ear_drop"]
    fp16 = point["comparisons"][0]
    assert drop["label"] == fp16["label"] == "FP16"
    assert drop["test"]["test"] == "fisher_exact_less"
    assert (drop["test"]["latest_successes"], drop["test"]["latest_n"]) == (
        fp16["exact"],
        fp16["n"],
    )
    assert (drop["test"]["baseline_successes"], drop["test"]["baseline_n"]) == (120, 120)
    assert drop["test"]["p_value"] <= drop["test"]["alpha"] == 0.01
    assert "Fisher" in drop["message"] and "120/120" in drop["message"]

    # The old rows read back through the typed models: their points and their old flag.
    trend = client.get(f"/v1/audits/schedules/{sid}/trend", headers=h).json()["points"]
    assert [p["ear"] for p in trend[:3]] == [1.0, 1.0, 1.0]
    assert [c["self"] for c in trend[0]["comparisons"]] == [False, False, True]
    assert trend[0]["c_lift"]["comparison"] == 1
    [old] = trend[0]["flags"]
    assert old["kind"] == "ear_drop" and old["label"] == "fp16" and old["test"] is None
    assert old["message"] == OLD_SHAPE_FLAG["message"]

    # The alert is stored and handed to the alert runner (not delivered inline).
    [spec] = alerts.specs
    assert spec.func == "replay_audit.audits.tasks.deliver_alert" and spec.queue == "audit"
    [alert] = client.get(f"/v1/audits/schedules/{sid}/alerts", headers=h).json()["items"]
    assert alert["status"] == "pending" and alert["attempts"] == 0
    assert alert["audit_run_id"] == run["id"] and alert["url"].endswith("T0K3N")
    masked = client.get(f"/v1/audits/schedules/{sid}/alerts", headers=headers("auditor")).json()
    assert masked["items"][0]["url"] == "https://hooks.example.com/..."
    # A second evaluation pass changes nothing and alerts nobody twice.
    assert tick().evaluated == 0 and len(alerts.specs) == 1
    # An alert the runner lost (Redis flushed, process restarted) is handed over again.
    alerts.drop()
    assert tick().alerts_enqueued == 1 and alerts.specs[-1].job_id == spec.job_id
