"""Replay runs over HTTP with fake engines: the request contract, the job, the aggregate, and
every way a request can be wrong. Runs on SQLite and PostgreSQL (the `db_url` fixture)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from replay_audit.db.unit_of_work import session_scope
from replay_audit.replays.models import ReplayJob, ReplayResult
from replay_audit.replays.reconcile import reconcile
from tests.replays.conftest import HoldingRunner, all_results, ingest
from tests.ui.conftest import sign_in

pytestmark = pytest.mark.usefixtures("worker_env")

PROMPTS = [[i, (i * 5) % 11, 3] for i in range(1, 13)]
FP16 = {"dtype": "fp16"}
FP16_C = {"dtype": "fp16", "intervention": {"kind": "C", "tau": 1e-3}}


def test_paired_replay_end_to_end(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS])
    r = client.post(
        "/v1/replays",
        json={"trace_ids": ids, "targets": [FP16, FP16_C], "compare_with": "self"},
        headers=h,
    )
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]

    queued = client.get(f"/v1/replays/{run_id}", headers=h).json()
    assert queued["status"] == "queued"
    assert queued["progress"] == {"total": 36, "done": 0, "failed": 0, "pending": 36}
    assert runner.run_all() == 1  # 12 traces: one job

    run = client.get(f"/v1/replays/{run_id}", headers=h).json()
    assert run["status"] == "done", run
    assert run["progress"] == {"total": 36, "done": 36, "failed": 0, "pending": 0}
    results = all_results(client, run_id, h, limit=5)
    assert len(results) == 36
    assert len({(x["trace_id"], x["comparison"]) for x in results}) == 36

    by_comp: dict[int, list[dict[str, Any]]] = {0: [], 1: [], 2: []}
    for x in results:
        by_comp[x["comparison"]].append(x)
    baseline, with_c, self_replay = by_comp[0], by_comp[1], by_comp[2]
    # The fixture's FP16 arm flips at close calls: some traces diverge, some do not.
    assert any(not x["exact_match"] for x in baseline)
    assert any(x["exact_match"] for x in baseline)
    # Self-replay in the logged configuration is exact; C repairs every flip of this model.
    assert all(x["exact_match"] for x in self_replay)
    assert all(x["exact_match"] for x in with_c)
    assert all(x["gate_triggers"] > 0 for x in with_c if x["arms"]["b"]["changed_steps"])

    traces = {i: client.get(f"/v1/traces/{i}", headers=h).json() for i in ids}
    for x in baseline:
        logged = traces[x["trace_id"]]["output_token_ids"]
        replayed = x["arms"]["b"]["output_token_ids"]
        if x["exact_match"]:
            assert replayed == logged and x["first_divergence_step"] is None
            assert x["category"] == "agreed"
            continue
        t = x["first_divergence_step"]
        # t* is the first mismatch, and the flip happened at a close call of both arms.
        assert replayed[:t] == logged[:t] and replayed[t] != logged[t]
        assert x["margin_at_divergence"]["a"]["source"] == "logged_top_k"
        assert x["margin_at_divergence"]["b"]["abs"] < 1e-3
        assert x["category"] == "head_reachable"
        assert x["cascade_length"] == len(logged) - t

    agg = run["statistics"]
    comps = {c["index"]: c for c in agg["comparisons"]}
    n_exact = sum(1 for x in baseline if x["exact_match"])
    assert comps[0]["ear"]["successes"] == n_exact and comps[0]["ear"]["n"] == 12
    assert comps[0]["ear"]["low"] <= n_exact / 12 <= comps[0]["ear"]["high"]
    assert comps[0]["categories"]["head_reachable"]["successes"] == 12 - n_exact
    assert comps[2]["ear"]["successes"] == 12
    lifts = {lift["comparison_b"]: lift for lift in agg["lifts"]}
    assert set(lifts) == {1}  # the self-replay is a reproducibility check, not a treatment
    assert lifts[1]["fixed"] == 12 - n_exact and lifts[1]["broke"] == 0
    assert lifts[1]["lift"] == pytest.approx((12 - n_exact) / 12)
    assert sorted(t["id"] for t in lifts[1]["fixed_traces"]) == sorted(
        x["trace_id"] for x in baseline if not x["exact_match"]
    )


def test_jobs_are_idempotent_and_reconciled(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
) -> None:
    h = headers("submitter")
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:3]])
    body = {"trace_ids": ids, "targets": [FP16], "idempotency_key": "nightly-1"}
    first = client.post("/v1/replays", json=body, headers=h)
    again = client.post("/v1/replays", json=body, headers=h)
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert len(runner.specs) == 1

    # Redis lost the job: the reconciler re-enqueues what the database says is unfinished.
    runner.specs.clear()
    with session_scope(db_url) as s:
        again_ids = reconcile(s, runner, stale_after_s=3600, job_timeout_s=60)
    assert len(again_ids) == 1 and len(runner.specs) == 1
    spec = runner.specs[0]
    runner.run_all()
    # A duplicate delivery of the same job changes nothing.
    from replay_audit.replays.tasks import run_replay_job

    run_replay_job(*spec.args)  # type: ignore[arg-type]
    with session_scope(db_url) as s:
        # 3 traces x (FP16, and the reproduction check every run begins with)
        assert s.scalar(select(func.count()).select_from(ReplayResult)) == 6
        assert s.scalars(select(ReplayJob.status)).all() == ["done"]
        assert reconcile(s, runner, stale_after_s=0, job_timeout_s=60) == []
    assert client.get(f"/v1/replays/{first.json()['id']}", headers=h).json()["status"] == "done"


def test_a_running_replay_job_is_never_started_a_second_time(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 33: a replay job running on one worker whose queued job Redis lost (a restart)
    is left alone by the reconciler, also past its heartbeat's staleness, and a second start
    of it (RQ delivering it again, or the reconciler's enqueue all the same) sees the first
    one's lease on the row and backs off: one attempt, one run, every result once."""
    import contextvars
    import threading

    from replay_audit.replays import tasks

    entered, release = threading.Event(), threading.Event()
    bodies: list[int] = []
    real = tasks._run_job

    def held_first(job_id: int, *args: Any) -> None:
        bodies.append(job_id)
        if len(bodies) == 1:  # the first start holds here (no transaction open) until released
            entered.set()
            release.wait(30)
        real(job_id, *args)

    monkeypatch.setattr(tasks, "_run_job", held_first)
    h = headers("admin")
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:3]])
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": [FP16]}, headers=h)
    assert r.status_code == 201, r.text
    [spec] = runner.specs
    runner.specs.clear()  # Redis restarted: its job is gone
    run = contextvars.copy_context().run  # the thread sees the worker context bound here
    first = threading.Thread(target=run, args=(tasks.run_replay_job, *spec.args))
    first.start()
    try:
        assert entered.wait(30)
        with session_scope(db_url) as s:
            assert reconcile(s, runner, stale_after_s=0, job_timeout_s=60) == []
        assert runner.specs == []
        tasks.run_replay_job(*spec.args)  # type: ignore[arg-type]  # a second start meanwhile
        assert len(bodies) == 1, "the second start ran beside the first"
    finally:
        release.set()
        first.join(30)
    assert not first.is_alive()
    assert client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()["status"] == "done"
    with session_scope(db_url) as s:
        [job] = s.scalars(select(ReplayJob)).all()
        assert (job.status, job.attempts, job.lease_until) == ("done", 1, None)
        assert s.scalar(select(func.count()).select_from(ReplayResult)) == 6  # each once


@pytest.mark.parametrize("away", ["the database", "Redis"])
def test_an_outage_past_the_jobs_patience_is_the_cause_it_gives_up_with(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    away: str,
) -> None:
    """Issue 33: each failure names its cause. The database (or Redis) goes away as each
    attempt of a replay job starts and stays away past the job's patience
    (`outlasting_outages`, made 0.5 s here; the outage lasts 0.7 s): each attempt is spent,
    raising the outage's error. A database outage's error cannot be recorded on the row while
    the database is still away: it is recorded once the database is back, so the give-up
    names the outage, not 'worker killed or crashing'."""
    import contextlib
    import time
    from collections.abc import Iterator

    from redis.exceptions import ConnectionError as RedisConnectionError
    from sqlalchemy.exc import OperationalError

    from replay_audit.db import job_row
    from replay_audit.replays import tasks

    monkeypatch.setattr(job_row, "OUTAGE_PATIENCE_S", 0.5)
    monkeypatch.setattr(job_row, "OUTAGE_BACKOFF_S", (0.02,))
    back_at = [0.0]  # when it answers again (monotonic seconds)
    database = away == "the database"
    error = OperationalError if database else RedisConnectionError

    def refused() -> Exception:
        if database:
            return OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))
        return RedisConnectionError("Error 111 connecting to redis:6379. connection refused.")

    def attempt(*_: Any) -> None:  # the job's body: it goes away as the attempt starts
        if time.monotonic() >= back_at[0]:
            back_at[0] = time.monotonic() + 0.7
        raise refused()

    real_scope = job_row.session_scope

    @contextlib.contextmanager
    def scope(url: str) -> Iterator[Any]:  # what the job writes on its row meanwhile
        if database and time.monotonic() < back_at[0]:
            raise refused()
        with real_scope(url) as s:
            yield s

    monkeypatch.setattr(tasks, "_run_job", attempt)
    monkeypatch.setattr(job_row, "session_scope", scope)
    h = headers("admin")
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:2]])
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": [FP16]}, headers=h)
    assert r.status_code == 201, r.text
    [spec] = runner.specs
    for n in range(1, tasks.MAX_JOB_ATTEMPTS + 1):
        with pytest.raises(error, match="connection refused"):
            tasks.run_replay_job(*spec.args)  # type: ignore[arg-type]
        with session_scope(db_url) as s:
            [job] = s.scalars(select(ReplayJob)).all()
            assert job.attempts == n  # spent
            assert job.error is not None and error.__name__ in job.error, job.error
    tasks.run_replay_job(*spec.args)  # type: ignore[arg-type]  # past its attempts
    run = client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()
    assert run["status"] == "failed", run
    said = run["error"]
    assert f"gave up after {tasks.MAX_JOB_ATTEMPTS} attempts" in said, said
    assert error.__name__ in said and "connection refused" in said, said
    assert "worker killed" not in said, said


def test_pairwise_both_arms(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:6]])
    bf16_c = {"dtype": "bf16", "intervention": {"kind": "C"}}
    r = client.post(
        "/v1/replays",
        json={
            "trace_ids": ids,
            "targets": [{"dtype": "bf16"}, FP16, bf16_c, FP16_C],
            "compare": "pairwise",
            "pairs": [[0, 1], [2, 3]],
        },
        headers=h,
    )
    assert r.status_code == 201, r.text
    runner.run_all()
    run = client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()
    assert run["status"] == "done"
    # The pairs asked for, then the reproduction check the run added (logged vs self).
    assert [(c["a"], c["b"]) for c in run["comparisons"]] == [(0, 1), (2, 3), ("logged", 4)]
    assert run["targets"][4]["self"] is True
    assert run["statistics"]["engine_reproduction"]["reproduced"]["successes"] == 6
    comps = {c["index"]: c for c in run["statistics"]["comparisons"]}
    # Both arms repaired by C agree everywhere in this model; unrepaired they do not.
    assert comps[1]["ear"]["successes"] == 6
    assert comps[0]["ear"]["successes"] < 6


def test_failed_items_say_why(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    unknown_model = logged_trace(PROMPTS[0])
    unknown_model["model"] = {**unknown_model["model"], "weights_sha256": "cd" * 32}
    ids = ingest(client, h, [unknown_model])
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": [FP16]}, headers=h)
    runner.run_all()
    run = client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()
    assert run["status"] == "failed"
    assert run["progress"]["failed"] == 2  # the comparison and the reproduction check
    for item in all_results(client, r.json()["id"], h):
        assert item["status"] == "failed"
        assert "no checkpoint with weights_sha256 " + "cd" * 32 in item["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"trace_ids": ["tr_nope"], "targets": [FP16]}, "trace_ids"),
        ({"filter": {"tag": "no-such-tag"}, "targets": [FP16]}, "filter"),
        ({"trace_ids": ["x"], "targets": []}, "targets"),
        ({"trace_ids": ["x"], "filter": {}, "targets": [FP16]}, "trace_ids"),
        ({"trace_ids": ["x"], "targets": [{"dtype": "fp64"}]}, "targets[0].dtype"),
        (
            {"trace_ids": ["x"], "targets": [{"dtype": "bf16", "lm_head_dtype": "fp8_e4m3"}]},
            "targets[0]",
        ),
        ({"trace_ids": ["x"], "targets": [FP16], "compare": "pairwise"}, "targets"),
        ({"trace_ids": ["x"], "targets": [FP16, FP16], "mode": "beam"}, "mode"),
    ],
)
def test_bad_requests_name_the_field(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    body: dict[str, Any],
    field: str,
) -> None:
    h = headers("admin")
    (trace_id,) = ingest(client, h, [logged_trace(PROMPTS[0])])
    if body.get("trace_ids") == ["x"]:
        body = {**body, "trace_ids": [trace_id]}
    r = client.post("/v1/replays", json=body, headers=h)
    assert 400 <= r.status_code < 500, r.text
    assert field in r.text, r.text
    assert runner.specs == []


def test_non_greedy_trace_is_refused(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    sampled = logged_trace(PROMPTS[1], decoding={"strategy": "sample", "max_new_tokens": 12})
    (trace_id,) = ingest(client, h, [sampled])
    r = client.post("/v1/replays", json={"trace_ids": [trace_id], "targets": [FP16]}, headers=h)
    assert r.status_code == 422 and "greedy" in r.text and trace_id in r.text
    # An imported greedy request with a processor a replay does not apply is `other`, and the
    # refusal names it.
    penalised = logged_trace(PROMPTS[2], decoding={"strategy": "other", "max_new_tokens": 12})
    penalised["config"]["extras"] = {"logits_processors": "frequency_penalty=0.5"}
    (trace_id,) = ingest(client, h, [penalised])
    r = client.post("/v1/replays", json={"trace_ids": [trace_id], "targets": [FP16]}, headers=h)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert (
        f"{trace_id} (logits processors a replay does not apply: frequency_penalty=0.5)" in detail
    )


def test_roles_and_projects(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    (trace_id,) = ingest(client, h, [logged_trace(PROMPTS[2])])
    body = {"trace_ids": [trace_id], "targets": [FP16]}
    assert client.post("/v1/replays", json=body, headers=headers("auditor")).status_code == 403
    assert client.post("/v1/replays", json=body).status_code == 401
    run_id = client.post("/v1/replays", json=body, headers=h).json()["id"]
    assert client.get(f"/v1/replays/{run_id}", headers=headers("auditor")).status_code == 200
    # A submitter polls the status of runs but does not read replayed tokens.
    submitter = headers("submitter")
    assert client.get(f"/v1/replays/{run_id}", headers=submitter).status_code == 200
    assert client.get(f"/v1/replays/{run_id}/results", headers=submitter).status_code == 403
    assert client.get(f"/v1/replays/{run_id}/results", headers=h).status_code == 200
    other = headers("admin", project="other")
    assert client.get(f"/v1/replays/{run_id}", headers=other).status_code == 404
    assert client.get(f"/v1/replays/{run_id}/results", headers=other).status_code == 404
    # Another project's trace ids are unknown here.
    r = client.post("/v1/replays", json=body, headers=other)
    assert r.status_code == 422 and "trace_ids" in r.text


def test_a_filter_selects_like_the_trace_listing(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    tagged = ingest(client, h, [logged_trace(p) for p in PROMPTS[:3]])
    ingest(client, h, [logged_trace(p, tags=["canary"]) for p in PROMPTS[3:5]])
    r = client.post(
        "/v1/replays", json={"filter": {"tag": "production"}, "targets": [FP16]}, headers=h
    )
    assert r.status_code == 201, r.text
    runner.run_all()
    items = all_results(client, r.json()["id"], h)
    assert sorted(x["trace_id"] for x in items if x["comparison"] == 0) == sorted(tagged)


def test_tau_and_tau_ulps_together_are_refused_naming_both(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    (trace_id,) = ingest(client, h, [logged_trace(PROMPTS[5])])
    both = {"dtype": "fp16", "intervention": {"kind": "C", "tau": 1e-3, "tau_ulps": 2}}
    r = client.post("/v1/replays", json={"trace_ids": [trace_id], "targets": [both]}, headers=h)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["field"] == "targets[0].intervention"
    assert body["detail"] == (
        "targets[0].intervention: give tau (an absolute margin) or tau_ulps (ulps of the "
        "lm_head format), not both"
    )
    assert runner.specs == []
    # Either one alone is taken; the one given is the one used.
    for gate, expected in (({"tau_ulps": 2}, (1e-3, 2.0)), ({"tau": 0.01}, (0.01, None))):
        target = {"dtype": "fp16", "intervention": {"kind": "C", **gate}}
        r = client.post("/v1/replays", json={"trace_ids": [trace_id], "targets": [target]},
                        headers=h)  # fmt: skip
        assert r.status_code == 201, r.text
        t, check = client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()["targets"]
        assert (t["intervention"]["tau"], t["intervention"]["tau_ulps"]) == expected
        assert check["self"] is True  # the reproduction check every run begins with


def test_error_messages_carry_no_pydantic_prefixes(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    (trace_id,) = ingest(client, h, [logged_trace(PROMPTS[6])])
    r = client.post(
        "/v1/replays", json={"trace_ids": [trace_id], "filter": {}, "targets": [FP16]}, headers=h
    )
    assert r.status_code == 422
    assert r.json() == {
        "error": "FieldError",
        "detail": "give exactly one of trace_ids or filter",
        "field": "body",
    }


def test_a_cuda_target_here_says_what_it_needs(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    """A plain FP16 target on CUDA, on the embedded deployment without a GPU: the answer names
    the missing CUDA device, not the FP8 head's compute capability."""
    h = headers("admin")
    (trace_id,) = ingest(client, h, [logged_trace(PROMPTS[7])])
    cuda = {"dtype": "fp16", "device": "cuda"}
    r = client.post("/v1/replays", json={"trace_ids": [trace_id], "targets": [cuda]}, headers=h)
    assert r.status_code == 422, r.text
    assert "no CUDA device" in r.json()["detail"] and "8.9" not in r.json()["detail"]
    assert r.json()["field"].startswith("targets")


def test_a_stored_schedule_with_both_gates_still_reads() -> None:
    """Schedules stored before the refusal hold the default tau beside tau_ulps (the one used)."""
    from replay_audit.audits.schemas import ScheduleReplay
    from replay_audit.audits.service import STORED

    stored = {"targets": [{"dtype": "fp16", "intervention": {"kind": "C", "tau": 1e-3,
                                                             "tau_ulps": 2.0}}]}  # fmt: skip
    replay = ScheduleReplay.model_validate(stored, context=STORED)
    iv = replay.targets[0].intervention.to_domain()
    assert (iv.tau_ulps, iv.tau) == (2.0, 1e-3)


def test_a_pairwise_target_without_a_kernel_runs_the_logged_one_and_every_surface_says_so(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    api_key: Callable[..., str],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    """Traces logged with `eager`, a pairwise run whose targets name no kernel: both arms run
    `eager` (resolved once per trace, `kernel_source: logged`), and the results, the run's
    `ran` and the run page say `eager`, never "logged" for a kernel that was resolved."""
    h = headers("admin")
    config = {"dtype": "bf16", "attn_kernel": "eager", "device": "cpu"}
    ids = ingest(client, h, [logged_trace(p, config=config) for p in PROMPTS[:4]])
    body = {"trace_ids": ids, "targets": [{"dtype": "bf16"}, FP16], "compare": "pairwise"}
    r = client.post("/v1/replays", json={**body, "pairs": [[0, 1]]}, headers=h)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    runner.run_all()
    results = [x for x in all_results(client, run_id, h) if x["comparison"] == 0]
    assert len(results) == 4 and all(x["status"] == "ok" for x in results)
    for x in results:
        for arm in ("a", "b"):
            resolved = x["arms"][arm]["resolved"]
            assert (resolved["attn_kernel"], resolved["kernel_source"]) == ("eager", "logged")
            assert x["arms"][arm]["environment"]["attn_kernel"] == "eager"
    run = client.get(f"/v1/replays/{run_id}", headers=h).json()
    ran, check = run["ran"]  # the pair, then the reproduction check (the logged config, here)
    assert check["comparison"] == 1 and check["a"] is None and check["b"]["attn_kernel"] == "eager"
    assert ran["results"] == 4 and ran["a"]["attn_kernel"] == ran["b"]["attn_kernel"] == "eager"
    assert ran["label_a"] == "bf16 / eager / cpu" and ran["label_b"] == "fp16 / eager / cpu"
    # The run page: the targets say the kernel was left to each trace, and what ran says eager.
    client.cookies.clear()
    assert sign_in(client, api_key("auditor")).status_code == 303
    page = client.get(f"/ui/runs/{run_id}").text
    ran_table = page[page.index('id="ran"') : page.index("</table>", page.index('id="ran"'))]
    assert "bf16 / eager / cpu" in ran_table and "fp16 / eager / cpu" in ran_table
    assert "(kernel: logged)" in ran_table and "engine default" not in ran_table
    targets = page[page.index('id="targets"') : page.index("</table>", page.index('id="targets"'))]
    assert "each trace&#39;s logged kernel" in targets or "each trace's logged kernel" in targets


def test_each_result_says_where_its_traces_ids_came_from(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    """A trace imported from text (`config.extras.token_ids_source`) says so on each of its
    results: a divergence there may be a re-tokenisation's split, not the format."""
    h = headers("admin")
    retokenized = logged_trace(PROMPTS[0])
    retokenized["config"]["extras"] = {"token_ids_source": "retokenized"}
    ids = ingest(client, h, [retokenized, logged_trace(PROMPTS[1])])
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": [FP16]}, headers=h)
    assert r.status_code == 201, r.text
    runner.run_all()
    results = all_results(client, r.json()["id"], h)
    by_trace = {x["trace_id"]: x["token_ids_source"] for x in results}
    assert by_trace == {ids[0]: "retokenized", ids[1]: None}
