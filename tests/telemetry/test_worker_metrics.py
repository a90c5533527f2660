"""A real `replay-audit worker` (RQ, PostgreSQL, a tiny random Llama on the CPU) serves its own
metrics: the replay job it ran, the tokens it decoded, the model it loaded. The API's scrape
shows the queue filling and draining, and /readyz the live worker by GPU kind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from replay_audit.api.app import create_app
from replay_audit.auth.service import create_api_key
from replay_audit.config import Settings
from replay_audit.db.unit_of_work import session_scope
from replay_audit.queue.state import WORKER_KINDS
from tests.conftest import RedisNamespace, empty_all_tables
from tests.telemetry.scrape import samples, value

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def checkpoint_and_traces(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    from replay_audit.engine.generate import generate_traces
    from replay_audit.engine.testing import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("metrics-tiny-llama"))
    prompts = [(f"w{i}", f"def g{i}(x):\n    return x + ") for i in range(3)]
    traces = generate_traces(checkpoint, prompts, dtype="bf16", max_new_tokens=8, device="cpu")
    return checkpoint, list(traces)


@pytest.fixture
def pg(postgres_database_url: str) -> Iterator[str]:
    yield postgres_database_url
    empty_all_tables(postgres_database_url)


def test_a_worker_serves_its_jobs_and_tokens(
    pg: str, rq_redis: RedisNamespace, checkpoint_and_traces: tuple[Path, list[Any]]
) -> None:
    checkpoint, traces = checkpoint_and_traces
    settings = Settings(_env_file=None, database_url=pg, **rq_redis.settings())  # type: ignore[call-arg]
    with session_scope(pg) as s:
        h = {"X-API-Key": create_api_key(s, "acme", "admin").key}
    with TestClient(create_app(settings)) as api:
        assert api.get("/readyz").json()["workers"] == {}
        ids = [
            i["id"]
            for i in api.post("/v1/traces:batch", json={"traces": traces}, headers=h).json()[
                "results"
            ]
        ]
        r = api.post(
            "/v1/replays", json={"trace_ids": ids, "targets": [{"dtype": "fp16"}]}, headers=h
        )
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        waiting = samples(api.get("/metrics").text)
        assert value(waiting, "replay_audit_queue_depth", queue="gpu") == 1
        assert value(waiting, "replay_audit_queue_oldest_job_age_seconds", queue="gpu") >= 0
        assert value(waiting, "replay_audit_queue_depth", queue="cpu") == 0

        port = _free_port()
        env = {
            **os.environ,
            **rq_redis.env(),
            "REPLAY_AUDIT_DATABASE_URL": pg,
            "REPLAY_AUDIT_RUNNER": "rq",
            "REPLAY_AUDIT_MODEL_DIRS": str(checkpoint),
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
        }
        args = [sys.executable, "-m", "replay_audit", "worker", "--queue", "gpu", "--device", "cpu"]
        worker = subprocess.Popen(
            [*args, "--metrics-port", str(port)], env=env, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 300
            while (run := api.get(f"/v1/replays/{run_id}", headers=h).json())["status"] != "done":
                assert run["status"] in ("queued", "running"), run
                assert worker.poll() is None, "the worker exited"
                assert time.monotonic() < deadline, "the replay did not finish"
                time.sleep(0.2)
            scraped = samples(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
            drained = samples(api.get("/metrics").text)
            ready = api.get("/readyz").json()
        finally:
            os.killpg(worker.pid, signal.SIGTERM)  # a warm shutdown: RQ lets the worker go
            worker.wait(timeout=60)
        assert api.get("/readyz").json()["workers"] == {}

    job = {"kind": "replay", "gpu_kind": "cpu"}
    assert value(scraped, "replay_audit_jobs_started_total", **job) == 1
    assert value(scraped, "replay_audit_jobs_finished_total", **job) == 1
    assert value(scraped, "replay_audit_jobs_failed_total", **job) == 0
    assert value(scraped, "replay_audit_job_duration_seconds_count", **job) == 1
    assert value(scraped, "replay_audit_job_duration_seconds_bucket", le="+Inf", **job) == 1
    # Three traces, each decoded in the target's format and in its logged one (the check).
    assert value(scraped, "replay_audit_replay_traces_total", stage="decoded", gpu_kind="cpu") == 6
    assert value(scraped, "replay_audit_replay_tokens_total", stage="decoded", gpu_kind="cpu") >= 3
    assert value(scraped, "replay_audit_model_loads_total") >= 1
    assert value(drained, "replay_audit_queue_depth", queue="gpu") == 0
    assert value(drained, "replay_audit_workers_live", gpu_kind="cpu") == 1
    assert ready["workers"] == {"cpu": 1} and ready["status"] == "ok"
    # The worker took its GPU kind back out of Redis as it stopped.
    assert not rq_redis.connection.hgetall(rq_redis.prefix + WORKER_KINDS)


def test_a_second_worker_on_a_taken_metrics_port_says_so(pg: str, rq_redis: RedisNamespace) -> None:
    # Two workers of one host with the default port: the second must name the port, not the
    # database (the CLI's catch-all once read EADDRINUSE as a database that cannot be opened).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {
            **os.environ,
            **rq_redis.env(),
            "REPLAY_AUDIT_DATABASE_URL": pg,
            "REPLAY_AUDIT_METRICS_HOST": "127.0.0.1",
            "REPLAY_AUDIT_WORKER_METRICS_PORT": str(port),
        }
        args = [sys.executable, "-m", "replay_audit", "worker", "--burst", "--device", "cpu"]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in proc.stderr
    assert "--metrics-port" in proc.stderr and "database" not in proc.stderr


def test_kinds_a_request_names_do_not_grow_the_queue_labels(
    pg: str, rq_redis: RedisNamespace, checkpoint_and_traces: tuple[Path, list[Any]]
) -> None:
    """A submitter can name any GPU kind in a target; each makes a queue no worker serves.
    The scrape gives the fixed queues (and those a live worker serves) a label each and sums
    the rest under `unserved`, so invented kinds cannot grow /metrics (an open endpoint)."""
    _, traces = checkpoint_and_traces
    settings = Settings(_env_file=None, database_url=pg, **rq_redis.settings())  # type: ignore[call-arg]
    with session_scope(pg) as s:
        h = {"X-API-Key": create_api_key(s, "acme", "admin").key}
    with TestClient(create_app(settings)) as api:
        results = api.post("/v1/traces:batch", json={"traces": traces}, headers=h).json()
        ids = [i["id"] for i in results["results"]]
        for n in range(12):
            target = {"dtype": "fp16", "device": "cuda", "gpu_kind": f"invented{n}"}
            r = api.post("/v1/replays", json={"trace_ids": ids, "targets": [target]}, headers=h)
            assert r.status_code == 201, r.text
        scraped = samples(api.get("/metrics").text)
    labels = {dict(ls)["queue"] for (n, ls) in scraped if n == "replay_audit_queue_depth"}
    assert "unserved" in labels and not any(q.startswith("gpu:invented") for q in labels)
    assert len(labels) <= 6, labels  # gpu, cpu, their long queues, audits, unserved
    assert value(scraped, "replay_audit_queue_depth", queue="unserved") == 12


def test_scrapes_within_a_read_share_one_read_of_the_queues(
    pg: str, rq_redis: RedisNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33: a scrape reads every queue from Redis (hundreds of round trips where requests
    named many kinds); scrapers back to back or at once share one read per QUEUE_READ_TTL_S
    instead of each paying it in the API process (BENCHMARKS.md: the single-POST p99 with 4
    scrapers)."""
    from replay_audit.api import metrics

    reads: list[int] = []
    real = metrics.known_queues

    def counted(*a: Any, **k: Any) -> list[str]:
        reads.append(1)
        return real(*a, **k)

    monkeypatch.setattr(metrics, "known_queues", counted)
    settings = Settings(_env_file=None, database_url=pg, **rq_redis.settings())  # type: ignore[call-arg]
    collector = metrics.QueueCollector(settings)
    first = [f.name for f in collector.collect()]
    again = [f.name for f in collector.collect()]
    assert len(reads) == 1 and first == again and "replay_audit_queue_depth" in first
    monkeypatch.setattr(metrics, "QUEUE_READ_TTL_S", 0.0)
    list(collector.collect())
    assert len(reads) == 2  # past the TTL: read again
