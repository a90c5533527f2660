"""Routing a replay run's jobs by GPU kind and tensor-parallel degree, with fake engines (the
whole-system version with real RQ worker processes: test_rq_routing.py). Runs on SQLite and
PostgreSQL (the `db_url` fixture)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.queue.route import Route
from replay_audit.queue.runner import InProcessRunner
from replay_audit.replays.domain import LoggedPlacement, RunTarget
from replay_audit.replays.reconcile import reconcile
from replay_audit.replays.service import route_of
from tests.replays.conftest import HoldingRunner, all_results, ingest
from tests.ui.conftest import sign_in

pytestmark = pytest.mark.usefixtures("worker_env")

PROMPTS = [[i, (i * 5) % 11, 3] for i in range(1, 7)]
FP16 = {"dtype": "fp16"}
A10G = {"device": "cuda", "gpu": {"name": "NVIDIA A10G", "sm": "8.6"}}
L4 = {"device": "cuda", "gpu": {"name": "NVIDIA L4", "sm": "8.9"}}


def _on(logged_trace: Callable[..., dict[str, Any]], prompt: list[int], **config: Any) -> Any:
    """A trace the fake BF16 arm produced, its configuration saying where it was logged."""
    return logged_trace(prompt, config={"dtype": "bf16", "attn_kernel": "sdpa", **config})


def test_the_route_is_the_logged_kind_and_degree_unless_a_target_names_another() -> None:
    from replay_audit.engine import Target

    t = RunTarget(Target("fp16"))
    a10g_tp2 = LoggedPlacement("NVIDIA A10G", 2)
    assert route_of(a10g_tp2, [t], "gpu") == Route("gpu", "a10g", 2)
    assert route_of(LoggedPlacement(None, 1), [t], "gpu") == Route("gpu")  # logged on a CPU
    assert route_of(LoggedPlacement(None, None), [t], "gpu") == Route("gpu")  # TP not logged
    named = dataclasses.replace(t, gpu_kind="l4", tp_degree=1)
    assert route_of(a10g_tp2, [named], "gpu") == Route("gpu", "l4", 1)
    anywhere = dataclasses.replace(t, gpu_kind="any")
    assert route_of(a10g_tp2, [anywhere], "gpu") == Route("gpu", None, 2)
    # Every arm of a trace runs on one worker: it owns enough devices for the largest degree.
    tp1 = dataclasses.replace(t, tp_degree=1)
    assert route_of(a10g_tp2, [tp1, RunTarget(None)], "gpu") == Route("gpu", "a10g", 2)
    assert route_of(a10g_tp2, [tp1], "gpu") == Route("gpu", "a10g", 1)
    # The reproduction check a run adds goes where the degree a target names runs (and fails
    # there saying why); where none names one, it runs at the logged degree like any self arm.
    from replay_audit.replays.domain import ENGINE_CHECK_LABEL

    check = RunTarget(None, label=ENGINE_CHECK_LABEL)
    assert route_of(a10g_tp2, [tp1, check], "gpu") == Route("gpu", "a10g", 1)
    assert route_of(a10g_tp2, [t, check], "gpu") == Route("gpu", "a10g", 2)
    # On the CPU there is no kind.
    cpu = dataclasses.replace(t, device="cpu")
    assert route_of(a10g_tp2, [cpu], "gpu") == Route("cpu", None, 2)
    assert route_of(LoggedPlacement("NVIDIA A10G", 1), [t], "cpu") == Route("cpu")
    # A target naming a GPU kind and no device runs on that GPU, whatever the default queue.
    h100 = dataclasses.replace(t, gpu_kind="h100-80gb-hbm3")
    assert route_of(LoggedPlacement("NVIDIA A10G", 1), [h100], "cpu") == Route(
        "gpu", "h100-80gb-hbm3"
    )


def test_each_job_goes_to_the_queue_of_its_traces_logged_kind(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    h = headers("admin")
    traces = [_on(logged_trace, p, **(A10G if i % 2 else L4)) for i, p in enumerate(PROMPTS)]
    traces.append(_on(logged_trace, [9, 9, 9], device="cpu"))
    ids = ingest(client, h, traces)
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": [FP16]}, headers=h)
    assert r.status_code == 201, r.text
    queues = sorted(s.queue for s in runner.specs)
    assert queues == ["gpu", "gpu:a10g", "gpu:l4"]

    runner.specs.clear()
    anywhere = {**FP16, "gpu_kind": "any"}
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": [anywhere]}, headers=h)
    assert r.status_code == 201, r.text
    assert [s.queue for s in runner.specs] == ["gpu"]

    runner.specs.clear()
    h100 = {**FP16, "gpu_kind": "NVIDIA H100 80GB HBM3"}  # a name: stored as its kind
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": [h100]}, headers=h)
    assert r.status_code == 201, r.text
    assert [s.queue for s in runner.specs] == ["gpu:h100-80gb-hbm3"]
    run = client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()
    assert run["targets"][0]["gpu_kind"] == "h100-80gb-hbm3"


@pytest.mark.parametrize(
    ("targets", "field", "says"),
    [
        ([{**FP16, "gpu_kind": "a10g"}, {**FP16, "gpu_kind": "l4"}], "targets[1].gpu_kind", "one"),
        ([{**FP16, "gpu_kind": "a10g", "device": "cpu"}], "targets[0].gpu_kind", "device cpu"),
        ([{**FP16, "gpu_kind": "tp2"}], "targets[0].gpu_kind", "no GPU kind"),
        ([{**FP16, "gpu_kind": "cpu"}], "targets[0].gpu_kind", "no GPU kind"),
        ([{**FP16, "tp_degree": 0}], "targets[0].tp_degree", "greater than or equal to 1"),
    ],
)
def test_a_kind_or_degree_that_cannot_be_met_is_a_422_naming_the_field(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    targets: list[dict[str, Any]],
    field: str,
    says: str,
) -> None:
    h = headers("admin")
    ids = ingest(client, h, [_on(logged_trace, PROMPTS[0], **A10G)])
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": targets}, headers=h)
    assert r.status_code == 422, r.text
    assert field in r.text and says in r.text
    assert not runner.specs


@pytest.fixture
def in_process(client: TestClient) -> Iterator[InProcessRunner]:
    """The app's queue with an in-process runner built here, after `worker_env` bound the fake
    engines (its thread runs its jobs in a copy of this context)."""
    r = InProcessRunner(retry_scale=0)
    app_state = client.app.state  # type: ignore[attr-defined]
    app_state.queue = dataclasses.replace(app_state.queue, runner=r)
    yield r
    r.stop(10)


def test_a_tp2_trace_waits_with_its_reason_and_runs_at_tp1_only_when_asked(
    client: TestClient,
    in_process: InProcessRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
) -> None:
    h = headers("admin")
    ids = ingest(client, h, [_on(logged_trace, p, **A10G, tp_degree=2) for p in PROMPTS])
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": [FP16]}, headers=h)
    assert r.status_code == 201, r.text
    waiting_id = r.json()["id"]
    assert in_process.join(timeout_s=30)
    run = client.get(f"/v1/replays/{waiting_id}", headers=h).json()
    assert run["status"] == "queued" and run["progress"]["done"] == 0
    reason = run["pending_reason"]
    assert "TP 2" in reason and "gpu:a10g:tp2" in reason and "tp_degree: 1" in reason
    assert "cpu, 1 device" in reason  # the live worker: this process
    # A submitter polling its run reads the reason too.
    status = client.get(f"/v1/replays/{waiting_id}", headers=headers("submitter")).json()
    assert status["pending_reason"] == reason
    sign_in(client, h["X-API-Key"])
    page = client.get(f"/ui/runs/{waiting_id}")
    assert page.status_code == 200 and "gpu:a10g:tp2" in page.text
    # Held, not lost: the reconciler leaves the job alone.
    from replay_audit.db.unit_of_work import session_scope

    with session_scope(db_url) as s:
        assert reconcile(s, in_process, stale_after_s=3600, job_timeout_s=60) == []

    asked = {**FP16, "tp_degree": 1}
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": [asked]}, headers=h)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    assert in_process.join(timeout_s=60)
    run = client.get(f"/v1/replays/{run_id}", headers=h).json()
    assert run["status"] in ("done", "failed") and run["pending_reason"] is None, run
    items = all_results(client, run_id, h)
    asked_items = [i for i in items if i["comparison"] == 0]
    assert len(asked_items) == len(PROMPTS) and all(i["status"] == "ok" for i in asked_items)
    for i in asked_items:
        resolved = i["arms"]["b"]["resolved"]
        assert (resolved["tp_degree"], resolved["logged_tp_degree"]) == (1, 2)
        assert resolved["worker_kind"] == "cpu"
        assert i["baseline"] == "logged"  # the check could not say otherwise
    # The reproduction check needs the logged degree, which this worker does not own: it
    # fails saying so (the run went where the degree asked for runs).
    checks = [i for i in items if i["comparison"] == 1]
    assert len(checks) == len(PROMPTS) and all(i["status"] == "failed" for i in checks)
    assert all("was logged at TP 2" in i["error"] for i in checks)
    [ran] = run["ran"]
    assert "tp 1 (logged tp 2)" in ran["label_b"]
    # The first run still waits: nothing it asked for changed.
    assert client.get(f"/v1/replays/{waiting_id}", headers=h).json()["status"] == "queued"


def test_a_tp2_trace_fails_saying_so_where_a_worker_took_it_anyway(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    """A worker that runs a job it cannot serve (an `rq worker` by hand on every queue) fails
    each item saying why, instead of replaying at another degree than asked."""
    h = headers("admin")
    ids = ingest(client, h, [_on(logged_trace, PROMPTS[0], **A10G, tp_degree=2)])
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": [FP16]}, headers=h)
    run_id = r.json()["id"]
    assert runner.run_all() == 1
    items = all_results(client, run_id, h)
    assert len(items) == 2  # FP16, and the reproduction check
    for item in items:
        assert item["status"] == "failed" and "was logged at TP 2" in item["error"]
        # What a request can do: a target at TP 1; the check has only the logged degree.
        hint = "the reproduction check runs" if item["comparison"] == 1 else "tp_degree: 1"
        assert hint in item["error"], item


def test_an_audit_schedule_naming_two_gpu_kinds_is_refused_when_it_is_created(
    client: TestClient, headers: Callable[..., dict[str, str]]
) -> None:
    """The rule is the request's, so a nightly schedule fails at creation, not every night."""
    from tests.audits.conftest import schedule_body

    targets = [{**FP16, "gpu_kind": "a10g"}, {**FP16, "gpu_kind": "NVIDIA L4"}]
    body = schedule_body(replay={"targets": targets})
    r = client.post("/v1/audits/schedules", json=body, headers=headers("admin"))
    assert r.status_code == 422, r.text
    assert "targets[1].gpu_kind" in r.text and "'l4'" in r.text
    ok = schedule_body(replay={"targets": [{**FP16, "gpu_kind": "NVIDIA L4"}]})
    assert client.post("/v1/audits/schedules", json=ok, headers=headers("admin")).status_code == 201
