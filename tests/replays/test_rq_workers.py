"""Replay runs on the production path: PostgreSQL, Redis and real RQ worker processes
(`replay-audit worker`), with a real (tiny, random) Llama checkpoint on the CPU.

Fault injection: a worker SIGKILLed mid-job, and Redis flushed mid-run (this test run's keys:
its namespace, see tests/conftest.py). In both, the reconciler
re-enqueues what the database says is unfinished and the run completes with exactly one result
per trace x comparison.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from replay_audit.api.app import create_app
from replay_audit.audits.tasks import RECONCILE_STALE_AFTER_S
from replay_audit.auth.service import create_api_key
from replay_audit.config import Settings
from replay_audit.db.job_row import LEASE_S, lease_live
from replay_audit.db.unit_of_work import session_scope
from replay_audit.queue.runner import RQRunner
from replay_audit.replays.models import ReplayJob, ReplayResult
from replay_audit.replays.reconcile import reconcile
from tests.conftest import RedisNamespace
from tests.rq_workers import start_worker, wait_until, worker_env

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]

TARGETS = [{"dtype": "fp16"}, {"dtype": "fp16", "intervention": {"kind": "C"}}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from replay_audit.engine.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("rq-tiny-llama"))


@pytest.fixture(scope="module")
def traces(checkpoint: Path) -> list[dict[str, Any]]:
    """48 traces generated in BF16 by transformers' generate() on the checkpoint."""
    from replay_audit.engine.generate import generate_traces

    prompts = [(f"p{i}", f"def f{i}(x, y):\n    return x * {i} + ") for i in range(48)]
    out = list(generate_traces(checkpoint, prompts, dtype="bf16", max_new_tokens=24, device="cpu"))
    return out


@pytest.fixture
def env(pg: str, checkpoint: Path, rq_redis: RedisNamespace) -> dict[str, str]:
    return worker_env(pg, checkpoint, rq_redis)


def _worker(env: dict[str, str], *, burst: bool) -> subprocess.Popen[bytes]:
    return start_worker(env, burst=burst)


def _request(api: tuple[TestClient, dict[str, str]], traces: list[dict[str, Any]]) -> str:
    client, h = api
    r = client.post("/v1/traces:batch", json={"traces": traces}, headers=h)
    assert r.status_code == 207
    ids = [i["id"] for i in r.json()["results"]]
    r = client.post("/v1/replays", json={"trace_ids": ids, "targets": TARGETS}, headers=h)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _results(pg: str) -> tuple[int, int]:
    with session_scope(pg) as s:
        n = s.scalar(select(func.count()).select_from(ReplayResult)) or 0
        distinct = (
            s.scalar(
                select(func.count()).select_from(
                    select(ReplayResult.trace_id, ReplayResult.comparison).distinct().subquery()
                )
            )
            or 0
        )
    return n, distinct


def _leased(pg: str) -> bool:
    """Whether a job holds a lease on a replay job now (`db.job_row.lease_live`)."""
    with session_scope(pg) as s:
        return any(lease_live(job) for job in s.scalars(select(ReplayJob)))


def _run(api: tuple[TestClient, dict[str, str]], run_id: str) -> dict[str, Any]:
    client, h = api
    body: dict[str, Any] = client.get(f"/v1/replays/{run_id}", headers=h).json()
    return body


def _reconcile(pg: str, redis: RedisNamespace) -> list[int]:
    runner = RQRunner(redis.url, prefix=redis.prefix)
    with session_scope(pg) as s:
        return reconcile(s, runner, stale_after_s=0, job_timeout_s=600)


def test_burst_workers_complete_a_paired_run(
    api: tuple[TestClient, dict[str, str]],
    traces: list[dict[str, Any]],
    env: dict[str, str],
    pg: str,
) -> None:
    run_id = _request(api, traces[:20])
    # The worker takes torch's CPU threads from the setting (the env says 1 for OpenMP).
    env = {**env, "REPLAY_AUDIT_TORCH_THREADS": "2"}
    assert _worker(env, burst=True).wait(timeout=300) == 0
    run = _run(api, run_id)
    assert run["status"] == "done", run
    # 20 traces x (2 targets + the reproduction check the run adds)
    assert run["progress"] == {"total": 60, "done": 60, "failed": 0, "pending": 0}
    assert _results(pg) == (60, 60)
    client, h = api
    items = client.get(f"/v1/replays/{run_id}/results?limit=500", headers=h).json()["items"]
    for c in run["statistics"]["comparisons"]:
        mine = [i for i in items if i["comparison"] == c["index"]]
        assert c["ear"]["successes"] == sum(1 for i in mine if i["exact_match"])
        assert c["gate_triggers"] == sum(i["gate_triggers"] for i in mine)
        # The worker records the numerical environment it actually used.
        assert all(i["arms"]["b"]["environment"]["device"] == "cpu" for i in mine)
        # The targets in FP16; the reproduction check in the logged BF16.
        dtype = "bf16" if c["label"].endswith("reproduction check") else "fp16"
        assert all(i["arms"]["b"]["environment"]["dtype"] == dtype for i in mine)
        assert all(i["arms"]["b"]["environment"]["extras"]["torch_threads"] == 2 for i in mine)


def test_sigkilled_worker_is_recovered_exactly_once(
    api: tuple[TestClient, dict[str, str]],
    traces: list[dict[str, Any]],
    env: dict[str, str],
    pg: str,
    rq_redis: RedisNamespace,
) -> None:
    run_id = _request(api, traces)
    total = 3 * len(traces)  # 2 targets + the reproduction check
    worker = _worker(env, burst=False)
    try:
        wait_until(lambda: _results(pg)[0] > 0, 120, "the first result")
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
    done_before, _ = _results(pg)
    assert 0 < done_before < total, "the worker should die mid-run"
    assert _run(api, run_id)["status"] == "running"
    # Its lease on the job lives on a little (`db.job_row.LEASE_S` past its last renewal):
    # till it lapses nothing takes the job, stale heartbeat or not; then it is lost.
    assert _reconcile(pg, rq_redis) == []
    wait_until(lambda: not _leased(pg), LEASE_S + 10, "the dead worker's lease to lapse")

    # Through the real command, in a fresh process (it once crashed there: models not imported).
    reconciled = subprocess.run(
        [sys.executable, "-m", "replay_audit", "reconcile", "--stale-after-s", "0"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert reconciled.returncode == 0, reconciled.stdout + reconciled.stderr
    assert re.search(r"re-enqueued [1-9]\d* jobs?\b", reconciled.stdout), reconciled.stdout
    assert _worker(env, burst=True).wait(timeout=300) == 0
    run = _run(api, run_id)
    assert run["status"] == "done", run
    assert _results(pg) == (total, total)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in {"Z", "X"}


def test_a_sigkilled_workers_job_is_finished_by_another_worker_within_a_minute(
    api: tuple[TestClient, dict[str, str]],
    traces: list[dict[str, Any]],
    env: dict[str, str],
    pg: str,
    rq_redis: RedisNamespace,
) -> None:
    """The reconciler's default staleness (900 s) plays no part: the killed worker's liveness
    key expires (ALIVE_TTL_S) and its lease on the job lapses (LEASE_S), and the next reconcile
    pass re-enqueues its job, which the other worker finishes. The worker alone is SIGKILLed
    (not its process group, as a container's death would): RQ's scheduler, forked beside it,
    must die with it."""
    run_id = _request(api, traces[:24])
    total = 3 * 24  # 2 targets + the reproduction check
    first = _worker(env, burst=False)
    second = None
    try:
        wait_until(lambda: _results(pg)[0] > 0, 120, "the first result")
        scheduler = _children(first.pid)
        assert scheduler, "RQ forks a scheduler process beside the worker"
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        killed_at = time.monotonic()
        assert _results(pg)[0] < total, "the worker should die mid-run"
        # Started after the kill: while it imported beside a running first worker, a loaded
        # machine let the first finish the whole job before the kill.
        second = _worker(env, burst=False)

        wait_until(
            lambda: not any(map(_running, scheduler)), 30, "the scheduler to die with its worker"
        )
        runner = RQRunner(rq_redis.url, prefix=rq_redis.prefix)
        reconciled: list[int] = []
        while _run(api, run_id)["status"] != "done":
            assert time.monotonic() - killed_at < 60, (
                f"run not finished a minute after the kill (re-enqueued: {reconciled})"
            )
            with session_scope(pg) as s:
                reconciled += reconcile(
                    s, runner, stale_after_s=RECONCILE_STALE_AFTER_S, job_timeout_s=600
                )
            time.sleep(2)
        print(f"finished {time.monotonic() - killed_at:.1f} s after the kill")
        assert reconciled, "the killed worker's job was re-enqueued"
        assert _results(pg) == (total, total)
    finally:
        for p in (first, second):
            if p is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def test_redis_flush_mid_run_is_recovered(
    api: tuple[TestClient, dict[str, str]],
    traces: list[dict[str, Any]],
    env: dict[str, str],
    pg: str,
    rq_redis: RedisNamespace,
) -> None:
    run_id = _request(api, traces)
    total = 3 * len(traces)  # 2 targets + the reproduction check
    worker = _worker(env, burst=True)
    wait_until(lambda: _results(pg)[0] > 0, 120, "the first result")
    rq_redis.flush()  # every queued job is gone; the one running finishes
    assert worker.wait(timeout=300) == 0
    assert _results(pg)[0] < total
    assert _run(api, run_id)["status"] == "running"

    assert _reconcile(pg, rq_redis)
    assert _worker(env, burst=True).wait(timeout=300) == 0
    assert _run(api, run_id)["status"] == "done"
    assert _results(pg) == (total, total)


def test_a_worker_announces_itself_again_after_redis_loses_it(
    env: dict[str, str], pg: str, rq_redis: RedisNamespace
) -> None:
    """A Redis restarted without persistence forgets RQ's worker registry and what each worker
    announced (its namespace flushed here): a live worker announces itself again within
    seconds, so `/readyz` requiring one worker answers 200 again and `/healthz` lists it."""
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, database_url=pg, ready_min_workers=1, **rq_redis.settings()
    )
    worker = start_worker(env)
    try:
        with TestClient(create_app(settings)) as client:
            wait_until(lambda: client.get("/readyz").status_code == 200, 120, "the worker")
            rq_redis.flush()
            wait_until(lambda: client.get("/readyz").status_code == 200, 15, "its new announce")
            assert client.get("/readyz").json()["workers"] == {"cpu": 1}
            kinds = client.get("/healthz").json()["worker_kinds"]
            assert [(k["kind"], k["workers"]) for k in kinds] == [("cpu", 1)]
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)


def test_a_cpu_only_deployment_serves_targets_without_a_device(
    traces: list[dict[str, Any]], env: dict[str, str], pg: str, rq_redis: RedisNamespace
) -> None:
    """`replay-audit worker --queue cpu` alone completes a run whose targets name no device
    when the deployment says its default queue is `cpu`; without that setting it says, when it
    starts, that such targets go to a queue it does not serve."""
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, database_url=pg, default_queue="cpu", **rq_redis.settings()
    )
    with session_scope(pg) as s:
        key = create_api_key(s, "acme", "admin").key
    with TestClient(create_app(settings)) as client:
        api = (client, {"X-API-Key": key})
        run_id = _request(api, traces[:2])
        cpu_only = [sys.executable, "-m", "replay_audit", "worker", "--queue", "cpu", "--burst"]
        worker = subprocess.run(
            cpu_only, env={**env, "REPLAY_AUDIT_DEFAULT_QUEUE": "cpu"},
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert worker.returncode == 0, worker.stderr[-3000:]
        assert "REPLAY_AUDIT_DEFAULT_QUEUE" not in worker.stderr
        assert _run(api, run_id)["status"] == "done"
    unset = subprocess.run(cpu_only, env=env, capture_output=True, text=True, timeout=300)
    assert unset.returncode == 0, unset.stderr[-3000:]
    assert "go to the 'gpu' queue (REPLAY_AUDIT_DEFAULT_QUEUE)" in unset.stderr
    assert "REPLAY_AUDIT_DEFAULT_QUEUE=cpu" in unset.stderr


def test_a_worker_takes_short_replay_jobs_before_a_long_screening_queued_earlier(
    traces: list[dict[str, Any]],
    checkpoint: Path,
    env: dict[str, str],
    pg: str,
    rq_redis: RedisNamespace,
) -> None:
    """A screening (a long job) waits on `gpu-long`; `worker --queue gpu` serves `gpu` first and
    then `gpu-long`, so the replay run asked for after the screening is run before it, and the
    screening still runs."""
    from replay_audit.engine.hashing import weights_sha256

    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, database_url=pg, model_dirs=[checkpoint], **rq_redis.settings()
    )
    with session_scope(pg) as s:
        key = create_api_key(s, "acme", "admin").key
    with TestClient(create_app(settings)) as client:
        h = {"X-API-Key": key}
        body = {
            "model_sha256": weights_sha256(checkpoint),
            "prompts": [{"id": "p0", "prompt_token_ids": [5, 6, 7]}],
            "max_new_tokens": 4,
        }
        r = client.post("/v1/screenings", json=body, headers=h)
        assert r.status_code == 201, r.text
        screening_id = r.json()["id"]
        run_id = _request((client, h), traces[:2])

        args = [sys.executable, "-m", "replay_audit", "worker", "--queue", "gpu", "--device", "cpu"]
        worker = subprocess.run(
            [*args, "--burst"], env=env, capture_output=True, text=True, timeout=300
        )
        assert worker.returncode == 0, worker.stderr[-3000:]
        assert _run((client, h), run_id)["status"] == "done"
        screening = client.get(f"/v1/screenings/{screening_id}", headers=h).json()
        assert screening["status"] == "done", screening

    # RQ logs each job as it takes it: every replay job before the screening.
    taken = re.findall(r"(run_replay_job|run_screening_job)\(", worker.stderr)
    assert "run_screening_job" in taken, worker.stderr[-3000:]
    assert taken[0] == "run_replay_job" and taken[-1] == "run_screening_job", taken
