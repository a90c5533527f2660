"""A schedule that verifies its samples (`verify`), with the fake engines, on SQLite and
PostgreSQL: the option's contract and checks, the run's verification beside its replay run
(the sampled traces, by id, under the schedule's idempotency key), a sample the verification
service refuses failing the run before anything is stored, and the evaluation waiting for the
verification (a failed one recorded, flagging nothing). The rule itself, on the bundled
checkpoint: tests/verifications/test_verification_audit.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from replay_audit.db.unit_of_work import session_scope
from replay_audit.replays.models import ReplayRun
from replay_audit.verifications import tasks as verification_tasks
from replay_audit.verifications.models import Verification
from replay_audit.worker.checkpoint import ModelNotFound
from tests.audits.conftest import PROMPTS, HoldingRunner, ingest, schedule_body
from tests.ui.conftest import settings as settings  # fixture: the session secret
from tests.ui.conftest import ui_client as ui_client  # fixture

Headers = Callable[..., dict[str, str]]
MakeSchedule = Callable[..., tuple[str, dict[str, str]]]
VERIFY = {"group_by": "engine"}


def _count(db_url: str, model: Any) -> int:
    with session_scope(db_url) as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"verify": {"group_by": "provider"}}, "group_by"),
        ({"verify": {"false_alarm_rate": 0}}, "false_alarm_rate"),
        ({"verify": {"surprise": 1}}, "surprise"),
        ({"verify": VERIFY, "sample_size": 2001}, "sample_size"),
        ({"verify": {"device": "cuda"}}, "verify.device"),  # the embedded runner, no GPU
    ],
)
def test_bad_verify_options_are_422(
    client: TestClient, headers: Headers, overrides: dict[str, Any], field: str
) -> None:
    r = client.post("/v1/audits/schedules", json=schedule_body(**overrides), headers=headers())
    assert r.status_code == 422, r.text
    assert field in r.text


def test_the_option_is_shown_and_bounds_the_sample_size(
    client: TestClient, make_schedule: MakeSchedule
) -> None:
    sid, h = make_schedule(verify=VERIFY)
    got = client.get(f"/v1/audits/schedules/{sid}", headers=h).json()
    assert got["verify"] == {"group_by": "engine", "false_alarm_rate": 0.01, "device": None}
    r = client.patch(f"/v1/audits/schedules/{sid}", json={"sample_size": 5000}, headers=h)
    assert r.status_code == 422 and r.json()["field"] == "sample_size", r.text
    plain, _ = make_schedule(name="plain")
    assert client.get(f"/v1/audits/schedules/{plain}", headers=h).json()["verify"] is None
    r = client.patch(f"/v1/audits/schedules/{plain}", json={"sample_size": 5000}, headers=h)
    assert r.status_code == 200, r.text


def test_a_run_verifies_its_sample_and_is_evaluated_once_both_finished(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    tick: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    ui_client: Callable[..., TestClient],
) -> None:
    sid, h = make_schedule(verify=VERIFY)
    ingest(client, h, [logged_trace(p) for p in PROMPTS[:12]])
    r = client.post(f"/v1/audits/schedules/{sid}/runs", headers=h)
    assert r.status_code == 201, r.text
    run = r.json()["run"]
    assert run["verification_id"].startswith("ver_") and run["verification_status"] == "queued"
    replay = client.get(f"/v1/replays/{run['replay_run_id']}", headers=h).json()
    verification = client.get(f"/v1/verifications/{run['verification_id']}", headers=h).json()
    key = replay["request"]["idempotency_key"]
    assert key == f"schedule:{sid}:{run['due_at'][:19]}Z"
    assert verification["request"]["idempotency_key"] == key
    assert verification["request"]["group_by"] == "engine"
    # The sample, by trace id: what the replay run replays.
    sample = verification["request"]["filter"]["trace_ids"]
    assert sorted(sample) == sorted(replay["request"]["trace_ids"]) and len(sample) == 8

    # The replay run finishes first: the audit run waits for its verification.
    [replay_spec] = [x for x in runner.specs if x.job_id.startswith("replay")]
    runner.specs.remove(replay_spec)
    held = list(runner.specs)
    runner.specs[:] = [replay_spec]
    assert runner.run_all() == 1
    assert tick().evaluated == 0
    got = client.get(f"/v1/audits/schedules/{sid}/runs", headers=h).json()["items"][0]
    assert got["status"] == "running" and got["replay_status"] == "done"

    # The verification fails on the worker (it has no such checkpoint): the run is evaluated,
    # its replay's figures stand, the failure is recorded and nothing is flagged for it.
    def missing(sha: str, *_: Any) -> Any:
        raise ModelNotFound(f"no checkpoint with weights_sha256 {sha} here")

    monkeypatch.setattr(verification_tasks, "find_checkpoint", missing)
    runner.specs[:] = held
    assert runner.run_all() == 1
    assert tick().evaluated == 1
    got = client.get(f"/v1/audits/schedules/{sid}/runs", headers=h).json()["items"][0]
    assert got["status"] == "done" and got["verification_status"] == "failed"
    assert "verification failed" in got["error"] and "no checkpoint" in got["error"]
    assert [f["kind"] for f in got["flags"]] == []
    [point] = client.get(f"/v1/audits/schedules/{sid}/trend", headers=h).json()["points"]
    assert point["verification"]["status"] == "failed" and point["ear"] is not None
    assert point["verification"]["id"] == run["verification_id"]
    page = ui_client("auditor").get(f"/ui/schedules/{sid}")
    assert page.status_code == 200 and "verification failed" in page.text, page.text
    assert "<th>Verdicts</th>" in page.text


def test_a_sample_the_verification_refuses_fails_the_run_storing_nothing(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
) -> None:
    """Traces claiming two checkpoints cannot be verified as one: the run fails saying so,
    before its replay run or its verification is stored (the run is not retried)."""
    sid, h = make_schedule(verify=VERIFY)
    traces = [logged_trace(p) for p in PROMPTS[:6]]
    traces[0]["model"]["weights_sha256"] = "e" * 64
    ingest(client, h, traces)
    r = client.post(f"/v1/audits/schedules/{sid}/runs", headers=h)
    assert r.status_code == 201, r.text
    run = r.json()["run"]
    assert run["status"] == "failed" and run["replay_run_id"] is None
    assert run["verification_id"] is None
    assert (
        run["error"].startswith("the sample's verification: ") and "2 checkpoints" in run["error"]
    )
    assert _count(db_url, ReplayRun) == _count(db_url, Verification) == 0
    assert runner.specs == []
