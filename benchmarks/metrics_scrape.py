"""Does scraping /metrics slow the API down? Single-POST latency with and without scrapers, over
real HTTP, on PostgreSQL (issue 33: with 337 queue labels made by submitters' invented GPU
kinds, 4 scrapers took the single-POST p99 from 52 to 447 ms).

    .venv/bin/python benchmarks/metrics_scrape.py [--runs 330] [--scrapers 4] [--rounds 4]

What it does: a fresh database on the PostgreSQL server (`REPLAY_AUDIT_TEST_PG_URL`, dropped
afterwards), `replay-audit serve` (one process, RQ on Redis with no worker, so runs wait in
their queues), one trace, then --runs replay runs whose targets name invented GPU
kinds (`gpu_kind`: "kind-0" ...), as the attack did. Then --rounds rounds, each two blocks of
--singles POST /v1/traces from one client over a kept-alive connection (`ingest._single_posts`):
one with no scraper, one with --scrapers threads scraping GET /metrics every --interval s, the
order alternating between rounds so that drift in the machine's load falls on both. Reports
each condition's p50/p95/p99 over all its rounds, the scrapes' count and p50, and the number
of label sets /metrics exposes. Measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import httpx
import numpy as np
import orjson
from ingest import (  # benchmarks/ingest.py (this script's directory is on sys.path)
    _single_posts,
    create_database,
    drop_database,
    free_port,
    make_trace,
    percentile,
    start_server,
)

from replay_audit.auth.service import create_api_key
from replay_audit.config import normalise_database_url
from replay_audit.db import migration
from replay_audit.db.unit_of_work import session_scope


def _summary(ms: list[float]) -> dict[str, float]:
    return {q: round(percentile(ms, v), 2) for q, v in (("p50", 50), ("p95", 95), ("p99", 99))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--server-url",
        default=os.environ.get(
            "REPLAY_AUDIT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    ap.add_argument(
        "--redis-url",
        default=os.environ.get("REPLAY_AUDIT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"),
    )
    ap.add_argument("--runs", type=int, default=330, help="runs naming invented GPU kinds")
    ap.add_argument("--scrapers", type=int, default=4)
    ap.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between a scraper's scrapes (0: back to back)",
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--singles", type=int, default=300, help="POSTs a block")
    args = ap.parse_args()

    server_url = normalise_database_url(args.server_url)
    rng = np.random.default_rng(0)
    database_url = create_database(server_url)
    proc = None
    try:
        migration.upgrade(database_url)
        with session_scope(database_url) as session:
            key = create_api_key(session, "bench", "admin").key
        port = free_port()
        # RQ on Redis, as the attack's deployment (the embedded runner refuses GPU targets);
        # no worker, so the runs stay queued, one queue label each before issue 33's fix.
        os.environ.update(
            REPLAY_AUDIT_RUNNER="rq",
            REPLAY_AUDIT_REDIS_URL=args.redis_url,
            REPLAY_AUDIT_QUEUE_PREFIX=f"scrape{port}",
        )
        proc = start_server(database_url, port, 1)
        base = f"http://127.0.0.1:{port}"
        headers = {"X-API-Key": key, "Content-Type": "application/json"}
        with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
            answer = client.post("/v1/traces", content=orjson.dumps(make_trace(rng)))
            assert answer.status_code == 201, answer.text
            trace_id = answer.json()["id"]
            for i in range(args.runs):
                target = {"dtype": "fp16", "device": "cuda", "gpu_kind": f"kind-{i}"}
                body = {"trace_ids": [trace_id], "targets": [target]}
                answer = client.post("/v1/replays", json=body)
                assert answer.status_code == 201, answer.text
            exposition = client.get("/metrics").text
        label_sets = sum(1 for line in exposition.splitlines() if line and line[0] != "#")

        stop = threading.Event()
        scrapes: list[float] = []

        def scrape() -> None:
            with httpx.Client(base_url=base, timeout=60) as c:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    assert c.get("/metrics").status_code == 200
                    scrapes.append((time.perf_counter() - t0) * 1000)
                    stop.wait(max(0.0, args.interval - (time.perf_counter() - t0)))

        latencies: dict[str, list[float]] = {"none": [], "scraped": []}
        for r in range(args.rounds):
            order = ("none", "scraped") if r % 2 == 0 else ("scraped", "none")
            for condition in order:
                bodies = [orjson.dumps(make_trace(rng)) for _ in range(args.singles + 20)]
                threads = []
                if condition == "scraped":
                    stop.clear()
                    threads = [threading.Thread(target=scrape) for _ in range(args.scrapers)]
                    for t in threads:
                        t.start()
                samples, _ = _single_posts(port, headers, bodies)
                stop.set()
                for t in threads:
                    t.join()
                latencies[condition] += [ms for ms, _ in samples]
        result = {
            "runs_with_invented_kinds": args.runs,
            "metrics_label_sets": label_sets,
            "scrapers": args.scrapers,
            "interval_s": args.interval,
            "rounds": args.rounds,
            "single_post_ms": {k: _summary(v) | {"n": len(v)} for k, v in latencies.items()},
            "scrapes": {"n": len(scrapes), "p50_ms": round(percentile(scrapes, 50), 2)},
            "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
        }
        print(json.dumps(result, indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        drop_database(server_url, database_url)


if __name__ == "__main__":
    main()
