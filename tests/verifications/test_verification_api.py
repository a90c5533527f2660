"""`/v1/verifications`: stored traces verified by the job (the bundled checkpoint, its null
measured once per session by tests/verifications/conftest.py and stored by the first job that
needs it): BF16-logged traces `consistent`, a 4-bit RTN copy's `inconsistent`, one verdict per
tag group; bad input a 4xx naming the field; project and role isolation; idempotency; a job
whose checkpoint is missing says why; the UI page; a verification whose worker died is enqueued
again by the reconciler, once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from replay_audit.config import Settings
from replay_audit.db.unit_of_work import session_scope
from replay_audit.replays import tasks as replay_tasks
from replay_audit.stats.verification import CALIBRATION_VERSION, Calibration
from replay_audit.verifications import tasks
from replay_audit.verifications.models import Verification, VerificationCalibration
from replay_audit.worker import context
from tests.factories import make_trace
from tests.replays.conftest import HoldingRunner
from tests.ui.conftest import settings as settings  # fixture: the session secret
from tests.ui.conftest import ui_client  # noqa: F401  (fixture)
from tests.verifications.conftest import store, verify


@pytest.mark.slow
def test_a_stored_calibration_of_an_older_method_or_another_shape_is_measured_again(
    client: TestClient,
    job_runner: HoldingRunner,
    null_claims: list[dict[str, Any]],
    logged: dict[str, list[dict[str, Any]]],
    headers: Callable[..., dict[str, str]],
) -> None:
    """A null stored by an older method (here 2: thresholds per variation, but no decision
    chosen per budget), or of another shape than the worker's settings ask, is not reused: the
    job measures it again and stores the new one, with its choices, in its place."""
    admin = headers("admin")
    store(client, admin, logged["bf16"], "honest")
    first = verify(client, admin, job_runner, filter={"tag": "honest"})["report"]
    assert first["calibrations"][0]["reused"] is False and len(null_claims) == 1
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    with session_scope(url) as s:
        row = s.scalars(select(VerificationCalibration)).one()
        older = {k: v for k, v in row.calibration.items() if k not in ("choices", "decision")}
        row.calibration = {**older, "version": 2}
    again = verify(client, admin, job_runner, filter={"tag": "honest"})["report"]
    assert again["calibrations"][0]["reused"] is False and len(null_claims) == 2
    with session_scope(url) as s:
        (stored,) = s.scalars(select(VerificationCalibration)).all()
        again_cal = Calibration.from_json(stored.calibration)
        assert again_cal.version == CALIBRATION_VERSION and again_cal.decision == "per_budget"
        assert [c.tokens for c in again_cal.choices] == [
            b.tokens for b in again_cal.budgets["outside_tie_band"]
        ]
    third = verify(client, admin, job_runner, filter={"tag": "honest"})["report"]
    assert third["calibrations"][0]["reused"] is True and len(null_claims) == 2

    # A worker set for a null of another shape measures it again; one whose prompts file gives
    # no prompts fails the verification, naming the setting.
    def worker_settings(**env: str) -> None:
        ctx = replay_tasks.worker_context()
        settings = ctx.settings.model_copy(update=env)
        context.install_worker_context(context.WorkerContext(settings, ctx.pool))

    worker_settings(verify_null_prompts=6)  # type: ignore[arg-type]
    fourth = verify(client, admin, job_runner, filter={"tag": "honest"})["report"]
    assert fourth["calibrations"][0]["reused"] is False and len(null_claims) == 3
    worker_settings(verify_null_prompts_file=Path("/nonexistent/prompts.jsonl"))  # type: ignore[arg-type]
    r = client.post("/v1/verifications", json={"filter": {"tag": "honest"}}, headers=admin)
    assert r.status_code == 201, r.text
    assert job_runner.run_all() == 1
    failed = client.get(f"/v1/verifications/{r.json()['id']}", headers=admin).json()
    assert failed["status"] == "failed"
    assert "REPLAY_AUDIT_VERIFY_NULL_PROMPTS_FILE (/nonexistent/prompts.jsonl)" in failed["error"]


@pytest.mark.slow
def test_honest_traces_are_consistent_and_4bit_ones_inconsistent(
    client: TestClient,
    job_runner: HoldingRunner,
    null_claims: list[dict[str, Any]],
    logged: dict[str, list[dict[str, Any]]],
    headers: Callable[..., dict[str, str]],
    ui_client: Callable[..., TestClient],  # noqa: F811
) -> None:
    admin = headers("admin")
    store(client, admin, logged["bf16"], "honest")
    store(client, admin, logged["rtn4"], "provider-x")
    got = verify(client, admin, job_runner, filter={"tag": "honest"})
    report = got["report"]
    assert report["verdict"] == "consistent", report["groups"]
    assert report["tokens"] == sum(len(t["output_token_ids"]) for t in logged["bf16"])
    (cal,) = report["calibrations"]
    assert cal["reused"] is False and cal["claim"]["dtype"] == "bf16"
    assert cal["false_alarm_rate"] == 0.01 and cal["budgets"] and cal["variations"]
    assert report["scanning_platform"]["device"] == "cpu"
    assert report["claimed_platforms"] == ["cpu"]
    assert len(null_claims) == 1

    # Both providers in one verification, a verdict per tag; the null is reused, not measured.
    got = verify(client, admin, job_runner, filter={"tags": []}, group_by="tag")
    both = got["report"]
    verdicts = {g["group"].split(" ")[0]: g for g in both["groups"]}
    assert verdicts["honest"]["verdict"] == "consistent"
    rtn = verdicts["provider-x"]
    assert rtn["verdict"] == "inconsistent", rtn
    assert rtn["score"] > rtn["threshold"] and rtn["closest_benign"] is not None
    assert rtn["tokens_needed"] is not None and rtn["sampled"] == 0
    assert both["verdict"] == "inconsistent" and both["calibrations"][0]["reused"] is True
    assert any(t["worst"] for t in both["traces"])
    assert len(null_claims) == 1
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


def test_a_trace_of_another_vocabulary_is_refused_on_its_own(
    client: TestClient,
    job_runner: HoldingRunner,
    null_claims: list[dict[str, Any]],
    logged: dict[str, list[dict[str, Any]]],
    headers: Callable[..., dict[str, str]],
) -> None:
    """A trace that claims the checkpoint's configuration with ids past its vocabulary (a
    larger `vocab_size`) would index the embedding out of range: the scan refuses it alone,
    naming the field, and the job verifies the others (it used to crash three times and end
    "worker killed")."""
    admin = headers("admin")
    honest = logged["bf16"]
    vocab = honest[0]["model"]["vocab_size"]
    alien = honest[0] | {
        "external_id": "alien",
        "model": honest[0]["model"] | {"vocab_size": vocab + 1000},
        "output_token_ids": [vocab + 7, *honest[0]["output_token_ids"][1:]],
        "top_k": None,
    }
    *_, alien_id = store(client, admin, [*honest, alien], "mixed")
    got = verify(client, admin, job_runner, filter={"tag": "mixed"})
    traces = {t["trace"]: t for t in got["report"]["traces"]}
    refused = traces[alien_id]
    assert refused["error"].startswith("model.vocab_size"), refused
    assert sum(t["error"] is None for t in traces.values()) == len(honest)
    assert got["report"]["verdict"] == "consistent"


T2030 = "2030-01-01T00:00:00Z"


def _body(**extra: Any) -> dict[str, Any]:
    return {"filter": {"tag": "test"}, **extra}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"filter": {"tag": "none-such"}}, "filter"),
        (_body(group_by="provider"), "group_by"),
        (_body(false_alarm_rate=0), "false_alarm_rate"),
        ({"filter": {"weights_sha256": "xyz"}}, "weights_sha256"),
        ({"filter": {"trace_ids": []}}, "trace_ids"),
        ({"filter": {"trace_ids": ["tr_none_such"]}}, "filter.trace_ids"),
        # An empty window selects no trace, as any filter may (issue 33: a schema rule before).
        ({"filter": {"created_after": T2030, "created_before": T2030}}, "filter"),
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
    if "created_after" in body.get("filter", {}):
        assert r.json()["detail"] == "the filter selects no trace", r.text


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


@pytest.mark.slow
def test_a_verification_whose_worker_died_is_enqueued_again_once(
    client: TestClient,
    job_runner: HoldingRunner,
    null_claims: list[dict[str, Any]],
    logged: dict[str, list[dict[str, Any]]],
    headers: Callable[..., dict[str, str]],
    settings: Settings,
) -> None:
    """A worker took the job (one attempt claimed, the row running) and died: its runner holds
    the job no more (under RQ: the worker's liveness key expired). The reconciler enqueues it
    once (not again while it is held), the job runs a second attempt to the one report, the
    null stored once; `replay-audit reconcile` takes one the same way."""
    from datetime import timedelta

    from replay_audit.audits.tasks import reconcile_jobs, run_tick
    from replay_audit.db.base import utcnow
    from replay_audit.db.job_row import claim_attempt
    from replay_audit.verifications.reconcile import reconcile_verifications

    admin = headers("admin")
    store(client, admin, logged["bf16"], "honest")
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]

    def died_mid_job(public_id: str) -> int:
        """The worker's claim on the row, then its death: the runner lost the job, and the
        lease on the row lapsed (`db.job_row.LEASE_S` after its last renewal)."""
        with session_scope(url) as s:
            row = s.scalar(select(Verification).where(Verification.public_id == public_id))
            assert row is not None and claim_attempt(row, tasks.MAX_ATTEMPTS)
            row.lease_until = utcnow() - timedelta(seconds=1)
            vid = row.id
        job_runner.specs.clear()
        return vid

    def read(vid: int) -> Verification:
        with session_scope(url) as s:
            row = s.get(Verification, vid)
            assert row is not None
            s.expunge(row)
            return row

    r = client.post("/v1/verifications", json={"filter": {"tag": "honest"}}, headers=admin)
    vid = died_mid_job(r.json()["id"])
    assert read(vid).status == "running" and read(vid).attempts == 1
    with session_scope(url) as s:
        assert reconcile_verifications(s, job_runner, job_timeout_s=60) == [vid]
    with session_scope(url) as s:  # held now: not enqueued a second time
        assert reconcile_verifications(s, job_runner, job_timeout_s=60) == []
        assert reconcile_jobs(s, job_runner, settings, stale_after_s=0) == []
    assert run_tick(settings, runner=job_runner, alert_runner=job_runner).jobs_reconciled == 0
    assert [spec.job_id for spec in job_runner.specs] == [f"verification-{vid}"]
    assert job_runner.run_all() == 1
    row = read(vid)
    assert (row.status, row.attempts, row.error) == ("done", 2, None), row.error
    assert row.report is not None and row.report["verdict"] == "consistent"
    with session_scope(url) as s:  # done: nothing to do
        assert reconcile_verifications(s, job_runner, job_timeout_s=60) == []
        assert s.scalar(select(func.count()).select_from(VerificationCalibration)) == 1
    assert len(null_claims) == 1

    # The command: with the embedded runner it runs the job in its process and waits for it
    # (the null stored above is reused: this platform, this claim).
    from typer.testing import CliRunner

    from replay_audit.cli import app as cli

    r = client.post(
        "/v1/verifications", json={"filter": {"tag": "honest"}, "group_by": "tag"}, headers=admin
    )
    second = died_mid_job(r.json()["id"])
    res = CliRunner().invoke(cli, ["reconcile"])
    assert res.exit_code == 0, res.output
    assert f"re-enqueued 1 job: [{second}]" in res.output and "done" in res.output
    row = read(second)
    assert (row.status, row.attempts) == ("done", 2), row.error
    assert row.report is not None and row.report["calibrations"][0]["reused"] is True
    assert len(null_claims) == 1 and job_runner.specs == []


def test_a_selection_past_the_token_budget_where_it_runs_is_refused(
    client: TestClient,
    job_runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 33: a verification's work (the tokens it scans) is bounded by its cost where it
    runs: on a CPU (this embedded deployment has no CUDA device) by the CPU budget. Nothing is
    stored or queued."""
    admin = headers("admin")
    for i in range(3):
        trace = make_trace(external_id=f"t{i}")
        assert client.post("/v1/traces", json=trace, headers=admin).status_code == 201
    tokens = 3 * (len(trace["prompt_token_ids"]) + len(trace["output_token_ids"]))
    app_settings = client.app.state.settings  # type: ignore[attr-defined]
    monkeypatch.setattr(app_settings, "verification_cpu_token_budget", tokens - 1)
    r = client.post("/v1/verifications", json=_body(), headers=admin)
    assert r.status_code == 422 and r.json()["field"] == "filter", r.text
    detail = r.json()["detail"]
    assert f"selects {tokens} tokens" in detail, detail
    assert f"REPLAY_AUDIT_VERIFICATION_CPU_TOKEN_BUDGET ({tokens - 1})" in detail
    assert job_runner.specs == []
    monkeypatch.setattr(app_settings, "verification_cpu_token_budget", tokens)
    assert client.post("/v1/verifications", json=_body(), headers=admin).status_code == 201


def test_a_verification_failing_every_attempt_gives_up_naming_what_it_raised(
    client: TestClient,
    job_runner: HoldingRunner,
    logged: dict[str, list[dict[str, Any]]],
    headers: Callable[..., dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 33: an attempt that raises an error the job does not handle is retried; once the
    attempts are spent the verification fails naming the last error, not 'worker killed or
    crashing' (which stays for a worker that died without a word)."""
    admin = headers("admin")
    store(client, admin, logged["bf16"][:2], "broken")
    r = client.post("/v1/verifications", json={"filter": {"tag": "broken"}}, headers=admin)
    assert r.status_code == 201, r.text
    public = r.json()["id"]

    def broken(*args: Any) -> None:
        raise TypeError("a bug in the job")

    monkeypatch.setattr(tasks, "_verify", broken)
    url = client.app.state.settings.database_url  # type: ignore[attr-defined]
    with session_scope(url) as s:
        vid = s.scalar(select(Verification.id).where(Verification.public_id == public))
    assert vid is not None
    for _ in range(tasks.MAX_ATTEMPTS):
        with pytest.raises(TypeError):
            tasks.run_verification_job(vid, url)
    tasks.run_verification_job(vid, url)  # the next start gives up
    got = client.get(f"/v1/verifications/{public}", headers=admin).json()
    assert got["status"] == "failed"
    assert got["error"] == (
        f"gave up after {tasks.MAX_ATTEMPTS} attempts; the last said TypeError: a bug in the job"
    )
