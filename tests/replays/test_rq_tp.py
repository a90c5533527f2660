"""Tensor-parallel replay on the production path: PostgreSQL, Redis and a real `replay-audit
worker --devices 2` process (announcing an A10G it does not have, its two devices two gloo
processes on the CPU), replaying traces that `replay-audit generate --tp 2` logged.

The worker announces two devices, takes the TP-2 job from `gpu:a10g:tp2`, replays it at TP 2
on the two ranks it starts (exact: the same computation that logged it), replays the same traces
at TP 1 when a run asks for TP 1 (each divergence with its category), keeps its ranks between
jobs, and stops them when it exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import RedisNamespace
from tests.replays.conftest import all_results
from tests.rq_workers import start_worker, wait_until, worker_env

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]

A10G = {"name": "NVIDIA A10G", "sm": "8.6"}
CATEGORIES = ("head_reachable", "kv_dependent", "body_dominated")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from replay_audit.engine.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp-route-tiny-llama"))


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def generated(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """`replay-audit generate --tp 2` on the CPU: two gloo processes run generate()."""
    where = tmp_path_factory.mktemp("tp-generate")
    prompts = where / "prompts.jsonl"
    lines = [json.dumps({"id": f"t{i}", "prompt": f"x = {i} * (y -"}) for i in range(6)]
    prompts.write_text("\n".join(lines) + "\n")
    out = where / "traces.jsonl"
    args = ["generate", "--model", str(checkpoint), "--prompts", str(prompts), "--out", str(out)]
    args += ["--tp", "2", "--device", "cpu", "--max-new-tokens", "24", "--threads", "1"]
    r = subprocess.run(
        [sys.executable, "-m", "replay_audit", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "wrote 6 traces" in r.stdout and "TP 2" in r.stdout, r.stdout
    traces = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(t["config"]["tp_degree"] == 2 for t in traces)
    return traces


def _logged_on_a10g(trace: dict[str, Any]) -> dict[str, Any]:
    """The trace as if logged on an A10G (its tokens are the CPU's, at its logged TP 2)."""
    return {**trace, "config": {**trace["config"], "device": "cuda", "gpu": A10G}}


def _ranks_of(parent: int) -> list[int]:
    """The tensor-parallel ranks that process `parent` started (their environment names it)."""
    mark = f"REPLAY_AUDIT_TP_PARENT_PID={parent}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


def test_a_two_device_worker_replays_tp2_traces_at_tp2_exactly_and_at_tp1_when_asked(
    api: tuple[TestClient, dict[str, str]],
    generated: list[dict[str, Any]],
    checkpoint: Path,
    pg: str,
    rq_redis: RedisNamespace,
) -> None:
    client, h = api
    r = client.post(
        "/v1/traces:batch", json={"traces": [_logged_on_a10g(t) for t in generated]}, headers=h
    )
    assert r.status_code == 207, r.text
    ids = [i["id"] for i in r.json()["results"]]

    def post(**body: Any) -> str:
        r = client.post("/v1/replays", json={"trace_ids": ids, **body}, headers=h)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def run(run_id: str) -> dict[str, Any]:
        body: dict[str, Any] = client.get(f"/v1/replays/{run_id}", headers=h).json()
        return body

    at_tp2 = post(compare_with="self")  # the logged configuration, at its logged TP 2
    at_tp1 = post(targets=[{"dtype": "bf16", "tp_degree": 1}])
    assert "owning 2 devices" in run(at_tp2)["pending_reason"]

    worker = start_worker(
        worker_env(pg, checkpoint, rq_redis),
        *("--gpu-name", A10G["name"], "--gpu-sm", A10G["sm"], "--devices", "2"),
    )
    try:
        wait_until(lambda: run(at_tp2)["status"] == "done", 300, "the TP-2 run")
        wait_until(lambda: run(at_tp1)["status"] == "done", 300, "the TP-1 run")
        health = client.get("/healthz").json()
        assert health["worker_kinds"] == [
            {"kind": "a10g", "gpu": "NVIDIA A10G", "sm": "8.6", "devices": 2, "workers": 1}
        ]
        ranks = _ranks_of(worker.pid)
        assert len(ranks) == 2, "the worker keeps its two ranks between jobs"
        worker.send_signal(signal.SIGTERM)  # the worker alone: it stops its ranks itself
        assert worker.wait(timeout=120) == 0
        wait_until(lambda: not _ranks_of(worker.pid), 30, "the ranks to stop with the worker")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)

    for item in all_results(client, at_tp2, h):
        assert item["status"] == "ok" and item["exact_match"] is True, item
        assert item["first_divergence_step"] is None and item["category"] == "agreed"
        resolved = item["arms"]["b"]["resolved"]
        assert (resolved["tp_degree"], resolved["logged_tp_degree"]) == (2, 2)
        assert resolved["worker_kind"] == "a10g"
        assert item["arms"]["b"]["environment"]["extras"]["tp_backend"] == "gloo"
    assert "tp 2" in run(at_tp2)["ran"][0]["label_b"]

    # The target at TP 1, and the reproduction check at the logged TP 2 (this worker owns two
    # devices): every trace reproduces.
    results = all_results(client, at_tp1, h)
    checks = [i for i in results if i["comparison"] == 1]
    assert len(checks) == len(generated) and all(i["exact_match"] for i in checks), checks
    assert all(i["arms"]["b"]["resolved"]["tp_degree"] == 2 for i in checks)
    at_1 = [i for i in results if i["comparison"] == 0]
    assert len(at_1) == len(generated)
    for item in at_1:
        assert item["status"] == "ok", item
        resolved = item["arms"]["b"]["resolved"]
        assert (resolved["tp_degree"], resolved["logged_tp_degree"]) == (1, 2)
        assert item["exact_match"] is (item["first_divergence_step"] is None)
        if item["exact_match"]:
            assert item["category"] == "agreed"
        else:
            assert item["category"] in CATEGORIES
    assert "tp 1 (logged tp 2)" in run(at_tp1)["ran"][0]["label_b"]
