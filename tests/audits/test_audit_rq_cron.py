"""The production path end to end: a real `rq cron replay_audit.audits.cron_config` process
ticking every second (instead of every minute), a real `replay-audit worker` serving the audit
and cpu queues, PostgreSQL and Redis, a real (tiny, random) Llama checkpoint on the CPU.

An hourly schedule that became active just before this hour: the cron process enqueues a tick
every second, the first one starts this hour's run, the worker replays it, a later tick
evaluates it; dozens of ticks, exactly one run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from replay_audit.api.app import create_app
from replay_audit.audits.models import AuditRun
from replay_audit.auth.service import create_api_key
from replay_audit.config import Settings
from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope
from tests.audits.conftest import set_active_since, set_created_at
from tests.conftest import RedisNamespace, empty_all_tables

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from replay_audit.engine.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("cron-tiny-llama"))


@pytest.fixture(scope="module")
def traces(checkpoint: Path) -> list[dict[str, Any]]:
    from replay_audit.engine.generate import generate_traces

    prompts = [(f"p{i}", f"def g{i}(a):\n    return a + {i} *") for i in range(6)]
    return list(
        generate_traces(
            checkpoint, prompts, dtype="bf16", max_new_tokens=12, device="cpu", tags=["production"]
        )
    )


@pytest.fixture
def pg(postgres_database_url: str) -> Iterator[str]:
    yield postgres_database_url
    empty_all_tables(postgres_database_url)


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.2)


def test_rq_cron_and_a_worker_run_the_nightly_audit(
    pg: str,
    rq_redis: RedisNamespace,
    checkpoint: Path,
    traces: list[dict[str, Any]],
    tmp_path: Path,
) -> None:
    settings = Settings(_env_file=None, database_url=pg, **rq_redis.settings())  # type: ignore[call-arg]
    with session_scope(pg) as s:
        key = create_api_key(s, "acme", "admin").key
    h = {"X-API-Key": key}
    hour = utcnow().replace(minute=0, second=0, microsecond=0)
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/traces:batch", json={"traces": traces}, headers=h)
        assert r.status_code == 207, r.text
        ids = [i["id"] for i in r.json()["results"]]
        body = {
            "name": "hourly production",
            "cron": "0 * * * *",
            "selection": {"tags": ["production"], "window_hours": 1},
            "sample_size": 4,
            "policy": "low_margin_first",
            "seed": 11,
            "replay": {"targets": [{"dtype": "fp16", "device": "cpu"}], "compare_with": "self"},
        }
        r = client.post("/v1/audits/schedules", json=body, headers=h)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
    set_created_at(pg, ids, hour - timedelta(minutes=30))
    set_active_since(pg, sid, hour - timedelta(minutes=1))

    env = {
        **os.environ,
        **rq_redis.env(),
        "REPLAY_AUDIT_DATABASE_URL": pg,
        "REPLAY_AUDIT_RUNNER": "rq",
        "REPLAY_AUDIT_MODEL_DIRS": str(checkpoint),
        "REPLAY_AUDIT_AUDIT_TICK_INTERVAL_S": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    rq = str(Path(sys.executable).parent / "rq")
    logs = [tmp_path / "cron.log", tmp_path / "worker.log"]
    cron_args = [rq, "cron", "replay_audit.audits.cron_config", "--url", rq_redis.url]
    cron = _start(cron_args, env, logs[0])
    worker = _start(
        [
            sys.executable,
            "-m",
            "replay_audit",
            "worker",
            "-q",
            "audit",
            "-q",
            "cpu",
            "--device",
            "cpu",
        ],
        env,
        logs[1],
    )

    def runs() -> list[AuditRun]:
        with session_scope(pg) as s:
            return list(s.scalars(select(AuditRun).order_by(AuditRun.due_at)))

    try:
        _wait(lambda: any(r.status == "done" for r in runs()), 240, "an evaluated run", logs)
        time.sleep(3)  # a few more ticks: still one run
    finally:
        _stop(cron)
        _stop(worker)

    from rq.cron import get_cron_job_ids

    ticks = get_cron_job_ids(f"{rq_redis.prefix}replay-audit-tick", rq_redis.connection)
    assert len(ticks) >= 5, "rq cron must have enqueued a tick every second"
    done = [r for r in runs() if r.due_at == hour]
    assert len(done) == 1 and done[0].trigger == "scheduled" and done[0].status == "done"
    assert len({r.due_at for r in runs()}) == len(runs())  # one run per due time, always
    run = done[0]
    assert run.n_candidates == 6 and run.n_sampled == 4
    metrics = run.metrics
    assert metrics is not None and metrics.ear is not None and 0.0 <= metrics.ear <= 1.0
    assert [c.label for c in metrics.comparisons] == ["fp16", "self (logged configuration)"]
    with TestClient(create_app(settings)) as client:
        replay = client.get(f"/v1/audits/schedules/{sid}/runs", headers=h).json()["items"][-1]
        assert replay["replay_status"] == "done"
        rr = client.get(f"/v1/replays/{replay['replay_run_id']}", headers=h).json()
        assert rr["schedule_id"] == sid and rr["progress"]["failed"] == 0
        point = client.get(f"/v1/audits/schedules/{sid}/trend", headers=h).json()["points"][-1]
        assert point["ear"] == rr["statistics"]["comparisons"][0]["ear"]["estimate"]
