"""`replay-audit serve --workers 2` on PostgreSQL, as real processes: the counters of both API
processes add up in one scrape (prometheus-client's multiprocess mode), and with
REPLAY_AUDIT_LOG_FORMAT=json a log line carries the request id the answer's header returned."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from replay_audit.auth.service import create_api_key
from replay_audit.db.unit_of_work import session_scope
from tests.conftest import empty_all_tables
from tests.factories import make_trace
from tests.serving import free_port, wait_healthy
from tests.telemetry.scrape import samples, value

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

INGESTED = "replay_audit_traces_ingested_total"


def _per_process(directory: Path, tmp: Path) -> dict[str, float]:
    """Traces created, as each process's own counter file says (pid -> count)."""
    out = {}
    for counters in directory.glob("counter_*.db"):
        alone = tmp / counters.stem
        alone.mkdir(exist_ok=True)
        shutil.copy(counters, alone / counters.name)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(alone))  # type: ignore[no-untyped-call]
        text = generate_latest(registry).decode()
        out[counters.stem] = value(samples(text), INGESTED, outcome="created")
    return out


def test_two_api_processes_add_up_and_log_json_lines(
    postgres_database_url: str, tmp_path: Path
) -> None:
    pg = postgres_database_url
    with session_scope(pg) as s:
        key = {"X-API-Key": create_api_key(s, "proc-project", "admin").key}
    port, prom, log = free_port(), tmp_path / "prom", tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_AUDIT_")}
    env |= {
        "REPLAY_AUDIT_DATABASE_URL": pg,
        "REPLAY_AUDIT_LOG_FORMAT": "json",
        "REPLAY_AUDIT_SCHEDULER": "off",
        "PROMETHEUS_MULTIPROC_DIR": str(prom),
    }
    prom.mkdir()
    (prom / "counter_1.db").write_bytes(b"stale")  # an earlier run's: emptied at start
    args = [sys.executable, "-m", "replay_audit", "serve", "--port", str(port), "--no-migrate"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*args, "--workers", "2"], cwd=tmp_path, env=env, stdout=out, stderr=out
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log)

        # Post on fresh connections, 8 at a time, until both processes have answered some.
        posted = 0
        while len([n for n in _per_process(prom, tmp_path).values() if n > 0]) < 2:
            assert posted < 400, "one process answered every request"
            threads = [
                threading.Thread(
                    target=lambda: httpx.post(f"{base}/v1/traces", json=make_trace(), headers=key)
                )
                for _ in range(8)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            posted += 8
        counts = _per_process(prom, tmp_path)
        assert sum(counts.values()) == posted, counts

        # Whichever process answers the scrape, it shows both processes' counts summed.
        for _ in range(4):
            scraped = samples(httpx.get(f"{base}/metrics").text)
            assert value(scraped, INGESTED, outcome="created") == posted
            assert (
                value(
                    scraped,
                    "replay_audit_http_requests_total",
                    method="POST",
                    route="/v1/traces",
                    status="201",
                )
                == posted
            )

        answer = httpx.post(f"{base}/v1/traces", json=make_trace(), headers=key)
        assert answer.status_code == 201
        request_id = answer.headers["X-Request-ID"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    mine = [x for x in lines if x.get("request_id") == request_id]
    [access] = [x for x in mine if x["logger"] == "replay_audit.access"]
    assert access["message"].startswith("POST /v1/traces 201 ")
    assert access["project"] == "proc-project"
    empty_all_tables(pg)
