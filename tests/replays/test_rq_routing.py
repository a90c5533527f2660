"""Routing by GPU kind and TP degree on the production path: PostgreSQL, Redis and real
`replay-audit worker` processes, each announcing a GPU kind it does not have (`--gpu-name`) and
replaying on the CPU with a real (tiny, random) Llama checkpoint.

Traces say they were logged on an A10G, on an L4, or on an A10G at TP 2. An A10G worker takes
the A10G traces and no others; the run says it waits for an L4 worker until one comes; the TP-2
run waits for a worker owning two devices, and runs at TP 1 only when asked, saying so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import RedisNamespace
from tests.replays.conftest import all_results
from tests.rq_workers import start_worker, wait_until, worker_env

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]

A10G = {"name": "NVIDIA A10G", "sm": "8.6"}
L4 = {"name": "NVIDIA L4", "sm": "8.9"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from replay_audit.engine.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("route-tiny-llama"))


@pytest.fixture(scope="module")
def generated(checkpoint: Path) -> list[dict[str, Any]]:
    from replay_audit.engine.generate import generate_traces

    prompts = [(f"r{i}", f"def h{i}(x):\n    return x - {i} * ") for i in range(8)]
    return list(generate_traces(checkpoint, prompts, dtype="bf16", max_new_tokens=8, device="cpu"))


def _logged_on(trace: dict[str, Any], gpu: dict[str, str], tp_degree: int = 1) -> dict[str, Any]:
    """The trace as if it had been logged on `gpu` at `tp_degree` (its tokens are the CPU's)."""
    config = {**trace["config"], "device": "cuda", "gpu": gpu, "tp_degree": tp_degree}
    return {**trace, "config": config, "external_id": f"{trace['external_id']}-{gpu['name']}"}


def _worker(
    pg: str, checkpoint: Path, redis: RedisNamespace, gpu: dict[str, str], *, burst: bool
) -> subprocess.Popen[bytes]:
    env = worker_env(pg, checkpoint, redis)
    return start_worker(env, "--gpu-name", gpu["name"], "--gpu-sm", gpu["sm"], burst=burst)


def test_jobs_land_on_their_kinds_workers_and_a_missing_kind_or_degree_says_so(
    api: tuple[TestClient, dict[str, str]],
    generated: list[dict[str, Any]],
    checkpoint: Path,
    pg: str,
    rq_redis: RedisNamespace,
) -> None:
    client, h = api
    traces = [_logged_on(t, A10G) for t in generated[:3]] + [
        _logged_on(t, L4) for t in generated[3:6]
    ]
    tp2 = [_logged_on(t, A10G, tp_degree=2) for t in generated[6:]]
    r = client.post("/v1/traces:batch", json={"traces": traces + tp2}, headers=h)
    assert r.status_code == 207, r.text
    ids = [i["id"] for i in r.json()["results"]]
    kind_of = dict(zip(ids, ["a10g"] * 3 + ["l4"] * 3 + ["a10g"] * 2, strict=True))

    def post(trace_ids: list[str], target: dict[str, Any]) -> str:
        r = client.post(
            "/v1/replays", json={"trace_ids": trace_ids, "targets": [target]}, headers=h
        )
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def run(run_id: str) -> dict[str, Any]:
        body: dict[str, Any] = client.get(f"/v1/replays/{run_id}", headers=h).json()
        return body

    by_kind = post(ids[:6], {"dtype": "fp16"})
    at_tp2 = post(ids[6:], {"dtype": "fp16"})
    at_tp1 = post(ids[6:], {"dtype": "fp16", "tp_degree": 1})
    # No worker yet: each run says what it waits for.
    assert "kind a10g" in run(by_kind)["pending_reason"]
    assert "kind l4" in run(by_kind)["pending_reason"]
    assert "live: none" in run(by_kind)["pending_reason"]

    a10g = _worker(pg, checkpoint, rq_redis, A10G, burst=False)
    try:
        wait_until(lambda: run(at_tp1)["status"] == "done", 240, "the TP-1 run on the A10G worker")
        # Each trace's fp16 replay and its reproduction check: two results a trace.
        wait_until(lambda: run(by_kind)["progress"]["done"] == 6, 240, "the A10G traces")
        assert a10g.poll() is None, "the A10G worker exited"
        waiting = run(by_kind)
        assert waiting["status"] == "running" and waiting["progress"]["pending"] == 6
        reason = waiting["pending_reason"]
        assert "kind l4" in reason and "kind a10g" not in reason
        assert "live: a10g (NVIDIA A10G, sm 8.6), 1 device x1" in reason
        health = client.get("/healthz").json()
        assert health["worker_kinds"] == [
            {"kind": "a10g", "gpu": "NVIDIA A10G", "sm": "8.6", "devices": 1, "workers": 1}
        ]
        # The TP-2 traces wait for a worker owning two devices, the A10G worker alive beside.
        held = run(at_tp2)
        assert held["status"] == "queued" and held["progress"]["done"] == 0
        assert (
            "owning 2 devices" in held["pending_reason"]
            and "tp_degree: 1" in held["pending_reason"]
        )
    finally:
        os.killpg(a10g.pid, signal.SIGTERM)  # a warm shutdown: RQ lets the worker go
        with contextlib.suppress(subprocess.TimeoutExpired):
            a10g.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(a10g.pid, signal.SIGKILL)

    # An L4 worker in burst mode: it takes the L4 job, leaves the A10G-only TP-2 job, and exits.
    assert _worker(pg, checkpoint, rq_redis, L4, burst=True).wait(timeout=300) == 0
    done = run(by_kind)
    assert done["status"] == "done" and done["pending_reason"] is None, done
    items = all_results(client, by_kind, h)
    assert len(items) == 12 and all(i["status"] == "ok" for i in items)
    for i in items:
        resolved = i["arms"]["b"]["resolved"]
        # Each trace ran on a worker of the kind it was logged on, and the result says which.
        assert resolved["worker_kind"] == kind_of[i["trace_id"]]
        assert resolved["device"] == "cpu" and resolved["tp_degree"] == 1
    # FP16 and the reproduction check (the logged BF16), each labelled with the worker that
    # ran it and what differs from the logging stack (these workers have no GPU).
    assert {r["label_b"] for r in done["ran"]} == {
        f"{dtype} / sdpa / cpu [worker {kind}] [stack differs: no GPU (logged NVIDIA {gpu})]"
        for dtype in ("fp16", "bf16")
        for kind, gpu in (("a10g", "A10G"), ("l4", "L4"))
    }

    # The target ran at TP 1; the reproduction check (the logged configuration, TP 2) could
    # not run on this one-device worker and says why, so the target's comparison is judged
    # against the logged tokens with no reproduction claimed either way.
    results = all_results(client, at_tp1, h)
    checks = [i for i in results if i["comparison"] == 1]
    assert len(checks) == 2 and all(
        i["status"] == "failed"
        and "was logged at TP 2; this worker owns 1 device" in i["error"]
        and "the reproduction check runs the logged degree only" in i["error"]
        for i in checks
    ), checks
    at_1 = [i for i in results if i["comparison"] == 0]
    assert len(at_1) == 2 and all(i["status"] == "ok" for i in at_1)
    assert all(i["engine_reproduced"] is None and i["baseline"] == "logged" for i in at_1)
    for i in at_1:
        resolved = i["arms"]["b"]["resolved"]
        assert (resolved["tp_degree"], resolved["logged_tp_degree"]) == (1, 2)
        assert resolved["worker_kind"] == "a10g"
    assert "tp 1 (logged tp 2)" in run(at_tp1)["ran"][0]["label_b"]
    assert run(at_tp2)["status"] == "queued"
    assert "live: none" in run(at_tp2)["pending_reason"]
