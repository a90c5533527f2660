"""`/v1/verifications`: stored traces verified by the job (the bundled checkpoint, its null
measured once per session by tests/verifications/conftest.py and stored by the first job that
needs it): BF16-logged traces `consistent`, a 4-bit RTN copy's `inconsistent`, one verdict per
tag group; bad input a 4xx naming the field; project and role isolation; idempotency; a job
whose checkpoint is missing says why; the UI page."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from replay_audit.config import BUNDLED_MODEL_DIR, Settings
from replay_audit.db.unit_of_work import session_scope
from replay_audit.engine import EnginePool
from replay_audit.replays import tasks as replay_tasks
from replay_audit.stats.verification import Calibration
from replay_audit.verifications import tasks
from replay_audit.verifications.models import Verification, VerificationCalibration
from tests.factories import make_trace
from tests.replays.conftest import HoldingRunner
from tests.ui.conftest import settings as settings  # fixture: the session secret
from tests.ui.conftest import ui_client  # noqa: F401  (fixture)


@pytest.fixture
def job_runner(client: TestClient) -> HoldingRunner:
    r = HoldingRunner()
    state = client.app.state  # type: ignore[attr-defined]
    state.queue = dataclasses.replace(state.queue, runner=r)
    return r


@pytest.fixture
def measured(
    monkeypatch: pytest.MonkeyPatch, db_url: str, verify_pool: EnginePool
) -> Iterator[list[dict[str, Any]]]:
    """Jobs run on the bundled checkpoint with the real engine; a null they measure is the
    session's (the list holds each claim measured)."""
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", db_url)
    monkeypatch.setenv("REPLAY_AUDIT_MODEL_DIRS", str(BUNDLED_MODEL_DIR))
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    replay_tasks.install_worker_context(replay_tasks.WorkerContext(settings, verify_pool))
    claims: list[dict[str, Any]] = []
    yield claims
    replay_tasks.install_worker_context(None)
    tasks.install_null_measure(None)


def _bind_null(claims: list[dict[str, Any]], calibrations: list[Calibration]) -> None:
    def measure(model_dir: Path, claim: dict[str, Any], rate: float, *_: Any) -> Calibration:
        assert model_dir == BUNDLED_MODEL_DIR and rate == 0.01
        claims.append(claim)
        return next(c for c in calibrations if c.claim == claim)

    tasks.install_null_measure(measure)


def _store(
    client: TestClient, admin: dict[str, str], traces: list[dict[str, Any]], tag: str
) -> None:
    for t in traces:
        body = t | {"tags": [tag], "external_id": f"{tag}-{t['external_id']}"}
        r = client.post("/v1/traces", json=body, headers=admin)
        assert r.status_code in (200, 201), r.text


def _verify(client: TestClient, admin: dict[str, str], runner: HoldingRunner, **body: Any) -> Any:
    r = client.post("/v1/verifications", json=body, headers=admin)
    assert r.status_code == 201, r.text
    assert runner.run_all() == 1
    got = client.get(f"/v1/verifications/{r.json()['id']}", headers=admin).json()
    assert got["status"] == "done", got["error"]
    return got


@pytest.mark.slow
def test_honest_traces_are_consistent_and_4bit_ones_inconsistent(
    client: TestClient,
    job_runner: HoldingRunner,
    measured: list[dict[str, Any]],
    logged: dict[str, list[dict[str, Any]]],
    calibrations: list[Calibration],
    headers: Callable[..., dict[str, str]],
    ui_client: Callable[..., TestClient],  # noqa: F811
) -> None:
    _bind_null(measured, calibrations)
    admin = headers("admin")
    _store(client, admin, logged["bf16"], "honest")
    _store(client, admin, logged["rtn4"], "provider-x")
    got = _verify(client, admin, job_runner, filter={"tag": "honest"})
    report = got["report"]
    assert report["verdict"] == "consistent", report["groups"]
    assert report["tokens"] == sum(len(t["output_token_ids"]) for t in logged["bf16"])
    (cal,) = report["calibrations"]
    assert cal["reused"] is False and cal["claim"]["dtype"] == "bf16"
    assert cal["false_alarm_rate"] == 0.01 and cal["budgets"] and cal["variations"]
    assert report["scanning_platform"]["device"] == "cpu"
    assert report["claimed_platforms"] == ["cpu"]
    assert len(measured) == 1

    # Both providers in one verification, a verdict per tag; the null is reused, not measured.
    got = _verify(client, admin, job_runner, filter={"tags": []}, group_by="tag")
    both = got["report"]
    verdicts = {g["group"].split(" ")[0]: g for g in both["groups"]}
    assert verdicts["honest"]["verdict"] == "consistent"
    rtn = verdicts["provider-x"]
    assert rtn["verdict"] == "inconsistent", rtn
    assert rtn["score"] > rtn["threshold"] and rtn["closest_benign"] is not None
    assert rtn["tokens_needed"] is not None and rtn["sampled"] == 0
    assert both["verdict"] == "inconsistent" and both["calibrations"][0]["reused"] is True
    assert any(t["worst"] for t in both["traces"])
    assert len(measured) == 1
    # The page: the score against the null as SVG, the worst tokens as text, linked from runs.
    ui = ui_client("auditor")
    page = ui.get(f"/ui/verifications/{got['id']}")
    assert page.status_code == 200, page.text
    assert "<svg" in page.text and "marker-score" in page.text and "<style" not in page.text
    worst = next(t for t in both["traces"] if t["worst"])
    step = worst["worst"][0]
    assert f"step {step['step']}: logged {step['logged']}" in page.text
    assert f"/verifications/{got['id']}" in ui.get("/ui/runs").text
    assert ui_client("auditor", "beta").get(f"/ui/verifications/{got['id']}").status_code == 404
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    with session_scope(url) as s:
        assert s.scalar(select(func.count()).select_from(VerificationCalibration)) == 1
        vid = s.scalar(select(Verification.id).where(Verification.public_id.is_not(None)).limit(1))
    # A retry of a done job changes nothing.
    tasks.run_verification_job(int(vid))
    with session_scope(url) as s:
        assert s.scalar(select(func.count()).select_from(VerificationCalibration)) == 1


def _body(**extra: Any) -> dict[str, Any]:
    return {"filter": {"tag": "test"}, **extra}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"filter": {"tag": "none-such"}}, "filter"),
        (_body(group_by="provider"), "group_by"),
        (_body(false_alarm_rate=0), "false_alarm_rate"),
        ({"filter": {"weights_sha256": "xyz"}}, "weights_sha256"),
        ({"filter": {"created_after": "2030-01-01", "created_before": "2020-01-01"}}, "filter"),
        (_body(device="tpu"), "device"),
        (_body(surprise=1), "surprise"),
        ({}, "filter"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(
    client: TestClient,
    job_runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    body: dict[str, Any],
    field: str,
) -> None:
    admin = headers("admin")
    assert client.post("/v1/traces", json=make_trace(), headers=admin).status_code == 201
    r = client.post("/v1/verifications", json=body, headers=admin)
    assert r.status_code == 422, r.text
    assert field in (r.json().get("field") or ""), r.text
    assert job_runner.specs == []


def test_traces_of_two_checkpoints_are_refused(
    client: TestClient, job_runner: HoldingRunner, headers: Callable[..., dict[str, str]]
) -> None:
    admin = headers("admin")
    for sha in ("a" * 64, "b" * 64):
        client.post("/v1/traces", json=make_trace(model={"weights_sha256": sha}), headers=admin)
    r = client.post("/v1/verifications", json=_body(), headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "filter.weights_sha256", r.text


def test_isolation_idempotency_and_a_missing_checkpoint(
    client: TestClient,
    job_runner: HoldingRunner,
    measured: list[dict[str, Any]],
    headers: Callable[..., dict[str, str]],
) -> None:
    admin = headers("admin")
    client.post("/v1/traces", json=make_trace(model={"weights_sha256": "c" * 64}), headers=admin)
    client.post("/v1/traces", json=make_trace(tags=["other"]), headers=headers("admin", "beta"))
    body = _body(idempotency_key="k1")
    first = client.post("/v1/verifications", json=body, headers=admin)
    again = client.post("/v1/verifications", json=body, headers=admin)
    assert (first.status_code, again.status_code) == (201, 200), first.text
    vid = first.json()["id"]
    assert vid.startswith("ver_") and first.json()["traces"] == 1
    assert again.json()["id"] == vid and len(job_runner.specs) == 1
    beta = headers("admin", "beta")
    assert client.get(f"/v1/verifications/{vid}", headers=beta).status_code == 404
    assert client.get(f"/v1/verifications/{vid}", headers=headers("submitter")).status_code == 403
    assert client.get("/v1/verifications/ver_nope", headers=admin).status_code == 404
    auditor = headers("auditor")
    assert client.post("/v1/verifications", json=_body(), headers=auditor).status_code == 403
    job_runner.run_all()
    got = client.get(f"/v1/verifications/{vid}", headers=auditor).json()
    assert got["status"] == "failed" and "c" * 16 in got["error"], got
    assert measured == []  # no null was measured for a checkpoint that is not there


@pytest.mark.parametrize(
    ("device", "default", "queue"),
    [
        (None, "cpu", "cpu-long"),
        (None, "gpu", "gpu-long"),
        ("cuda", "cpu", "gpu-long"),
        ("cpu", "gpu", "cpu-long"),
    ],
)
def test_a_verification_without_a_device_goes_to_the_default_queue(
    device: str | None, default: str, queue: str
) -> None:
    from replay_audit.verifications.service import job_spec

    row = Verification(id=7, request={"filter": {}, "device": device})
    assert job_spec(row, 60, default).queue == queue
