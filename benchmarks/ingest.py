"""Batch ingest throughput into PostgreSQL and single-POST latency, over real HTTP.

    .venv/bin/python benchmarks/ingest.py [--server-url postgresql+psycopg://postgres@127.0.0.1:5432/test]
                                          [--batches 20] [--batch-size 500] [--concurrency 2]
                                          [--singles 1000] [--single-concurrency 1]

What it does: creates a fresh database on the PostgreSQL server (dropped afterwards), applies
the migrations, creates a submitter key, starts `replay-audit serve --workers N` as a subprocess
on 127.0.0.1 (the command docker-compose runs), then with an httpx client:

  1. batch ingest: `--batches` POST /v1/traces:batch of `--batch-size` distinct traces (256
     prompt + 256 output tokens, top-2 ids and float32 logits per step, vocab 32,000), sent by
     `--concurrency` client threads; reports traces/s over the wall time of the whole phase;
  2. single POST latency: `--singles` POST /v1/traces of one such trace each, sent by
     `--single-concurrency` clients (1: sequential), each a process of its own with one
     kept-alive http.client connection (`--client threads`: threads of this process); reports
     p50/p95/p99 of the client-side round trip, the CPU per POST of the API, of the PostgreSQL
     backends of this database and of the clients, and the slowest 1% with the second each
     started.

Bodies are serialised before the clock starts (a real client pays for that on its own host).
The target (DESIGN.md) is >= 2,000 traces/s and p99 < 50 ms on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import multiprocessing
import os
import random
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replay_audit.auth.service import create_api_key  # noqa: E402
from replay_audit.config import normalise_database_url  # noqa: E402
from replay_audit.db import migration  # noqa: E402
from replay_audit.db.engine import dispose_engines  # noqa: E402
from replay_audit.db.unit_of_work import session_scope  # noqa: E402

VOCAB = 32_000


def make_trace(
    rng: np.random.Generator, n_prompt: int = 256, n_output: int = 256
) -> dict[str, Any]:
    prompt = rng.integers(0, VOCAB, n_prompt)
    output = rng.integers(0, VOCAB, n_output)
    second = (output + rng.integers(1, VOCAB, n_output)) % VOCAB
    top1 = rng.uniform(5.0, 25.0, n_output).astype(np.float32)
    top2 = (top1 - rng.uniform(0.0, 3.0, n_output).astype(np.float32)).astype(np.float32)
    return {
        "model": {
            "name": "tinyllama-1.1b",
            "revision": "main",
            "weights_sha256": "ab" * 32,
            "vocab_size": VOCAB,
        },
        "config": {
            "dtype": "bf16",
            "lm_head_dtype": "bf16",
            "device": "cuda",
            "gpu": {"name": "NVIDIA H100", "sm": "9.0"},
            "attn_kernel": "sdpa",
            "batch_size": 8,
            "engine": {"name": "vllm", "version": "0.6.0"},
        },
        "decoding": {
            "strategy": "greedy",
            "max_new_tokens": n_output,
            "eos_token_ids": [2],
            "stop_reason": "length",
        },
        "prompt_token_ids": prompt.tolist(),
        "output_token_ids": output.tolist(),
        "top_k": {
            "ids": np.stack([output, second], axis=1).tolist(),
            "logits": np.stack([top1, top2], axis=1).astype(np.float64).tolist(),
        },
        "tags": ["bench"],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def create_database(server_url: str) -> str:
    base = make_url(server_url)
    name = f"replay_audit_bench_{os.getpid()}_{secrets.token_hex(3)}"
    engine = create_engine(base, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return base.set(database=name).render_as_string(hide_password=False)


def drop_database(server_url: str, url: str) -> None:
    dispose_engines()
    engine = create_engine(make_url(server_url), isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)'))
    engine.dispose()


def start_server(database_url: str, port: int, workers: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, REPLAY_AUDIT_DATABASE_URL=database_url)
    proc = subprocess.Popen(
        # The product's own server command, as docker-compose runs it.
        [
            sys.executable,
            "-m",
            "replay_audit",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-migrate",
            "--log-level",
            "warning",
            "--workers",
            str(workers),
        ],
        cwd=ROOT,
        env=env,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and its children (uvicorn --workers forks them)."""
    total = cpu_seconds(pid)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid:
                    total += cpu_seconds(int(entry.name))
            except OSError:
                continue
    return total


def postgres_cpu(database: str) -> dict[int, float]:
    """CPU time, by process id, of the PostgreSQL backends connected to `database`: not those
    of other databases (other test runs on the same server), nor the server's shared processes
    (WAL writer, checkpointer), which work for every database."""
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "postgres":
                continue
            # A backend's title is "postgres: [CLUSTER:] USER DATABASE HOST(PORT) STATE".
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().split()
            host = next((i for i, word in enumerate(title) if "(" in word), None)
            if host is not None and host >= 2 and title[host - 1] == database:
                times[int(entry.name)] = cpu_seconds(int(entry.name))
        except OSError:
            continue
    return times


def postgres_cpu_since(database: str, before: dict[int, float]) -> float:
    """PostgreSQL CPU seconds spent since `before` (`postgres_cpu()`) by the processes alive
    now: a backend that exited in between is left out (a sum of totals would go negative)."""
    return sum(t - before.get(pid, 0.0) for pid, t in postgres_cpu(database).items())


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def _single_posts(
    port: int, headers: dict[str, str], bodies: list[bytes]
) -> tuple[list[tuple[float, float]], float]:
    """One client: POST /v1/traces of each body over one kept-alive connection (the standard
    library's http.client, the lightest client there is, so the two cores go to the service).
    Returns (milliseconds, start) per POST after the first 20, and this client's CPU seconds
    (its process's, when it is a process of its own)."""
    cpu0 = time.process_time()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    out = []
    for i, body in enumerate(bodies):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/traces", body=body, headers=headers)
        answer = conn.getresponse()
        payload = answer.read()
        dt = time.perf_counter() - t0
        assert answer.status == 201, payload[:500]
        if i >= 20:  # the first few warm the connection and the server's caches
            out.append((dt * 1000, t0))
    conn.close()
    return out, time.process_time() - cpu0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server-url",
        default=os.environ.get(
            "REPLAY_AUDIT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--singles", type=int, default=1000)
    parser.add_argument(
        "--single-concurrency",
        type=int,
        default=1,
        help="clients sending the single POSTs (issue 20 measures 8)",
    )
    parser.add_argument(
        "--client",
        choices=("processes", "threads"),
        default="processes",
        help="each single-POST client a process of its own (default) or a thread of this one",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="API processes (replay-audit serve --workers)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    server_url = normalise_database_url(args.server_url)
    rng = np.random.default_rng(args.seed)
    print(
        f"building {args.batches} x {args.batch_size} batch traces "
        f"and {args.singles} single traces ...",
        flush=True,
    )
    batch_bodies = [
        orjson.dumps({"traces": [make_trace(rng) for _ in range(args.batch_size)]})
        for _ in range(args.batches + 1)  # +1 warm-up
    ]
    n_single = max(1, args.single_concurrency)
    single_bodies = [orjson.dumps(make_trace(rng)) for _ in range(args.singles + 20 * n_single)]
    mb = sum(map(len, batch_bodies[1:])) / 1e6
    print(
        f"batch bodies: {mb:.1f} MB in total, "
        f"{len(batch_bodies[1]) / args.batch_size / 1e3:.1f} kB per trace",
        flush=True,
    )

    database_url = create_database(server_url)
    proc = None
    try:
        migration.upgrade(database_url)
        with session_scope(database_url) as session:
            key = create_api_key(session, "bench", "submitter").key
        database = str(make_url(database_url).database)
        port = free_port()
        proc = start_server(database_url, port, args.workers)
        base = f"http://127.0.0.1:{port}"
        headers = {"X-API-Key": key, "Content-Type": "application/json"}
        timeout = httpx.Timeout(120.0)

        with httpx.Client(base_url=base, headers=headers, timeout=timeout) as client:
            warm = client.post("/v1/traces:batch", content=batch_bodies[0])
            assert warm.status_code == 207, warm.text

        def send(body: bytes, client: httpx.Client) -> None:
            answer = client.post("/v1/traces:batch", content=body)
            assert answer.status_code == 207, answer.text
            statuses = {r["status"] for r in answer.json()["results"]}
            assert statuses == {201}, statuses

        clients = [
            httpx.Client(base_url=base, headers=headers, timeout=timeout)
            for _ in range(args.concurrency)
        ]
        server_cpu0, pg_cpu0 = tree_cpu_seconds(proc.pid), postgres_cpu(database)
        client_cpu0 = time.process_time()
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(
                pool.map(
                    lambda ib: send(ib[1], clients[ib[0] % len(clients)]),
                    enumerate(batch_bodies[1:]),
                )
            )
        elapsed = time.perf_counter() - start
        server_cpu = tree_cpu_seconds(proc.pid) - server_cpu0
        pg_cpu = postgres_cpu_since(database, pg_cpu0)
        client_cpu = time.process_time() - client_cpu0
        for c in clients:
            c.close()
        n_traces = args.batches * args.batch_size
        throughput = n_traces / elapsed

        # Each client sends its share, after 20 of its own to warm up.
        n = n_single
        warm_up, measured = single_bodies[: 20 * n], single_bodies[20 * n :]
        shares = [warm_up[20 * i : 20 * (i + 1)] + measured[i::n] for i in range(n)]
        send_one = partial(_single_posts, port, headers)
        server_cpu0, pg_cpu0 = tree_cpu_seconds(proc.pid), postgres_cpu(database)
        single_start = time.perf_counter()
        if args.client == "processes":
            # Each client is a process of its own (its own interpreter and GIL), as clients on
            # their own hosts are; forked after the bodies are built, so they share them.
            with multiprocessing.get_context("fork").Pool(n) as procs:
                answers = procs.map(send_one, shares)
        else:
            # Threads of this process: they share one GIL, whose waits land in their clocks.
            # The client's own garbage collector stays out of the figures: a full collection
            # stops all client threads at once, and their requests' clocks with them.
            gc.collect()
            gc.freeze()
            cpu0 = time.process_time()
            with ThreadPoolExecutor(n) as pool:
                answers = list(pool.map(send_one, shares))
            answers[0] = (answers[0][0], time.process_time() - cpu0)
            answers[1:] = [(a, 0.0) for a, _ in answers[1:]]
        single_elapsed = time.perf_counter() - single_start
        timed = [sample for samples, _ in answers for sample in samples]
        latencies = [ms for ms, _ in timed]
        client_cpu_s = sum(cpu for _, cpu in answers)
        # Slow requests that overlap in time point at a pause of the server (or the machine)
        # rather than at requests that are slow on their own.
        slow = sorted(timed, reverse=True)[: max(1, len(timed) // 100)]
        slow_at = [(round(ms, 1), round(t - single_start, 3)) for ms, t in slow]
        n_posts = len(single_bodies)
        # CPU per single POST (warm-up included in both the time and the count): what each
        # request costs the machine's two cores, whatever else runs on them.
        single_cpu = {
            "api": 1e3 * (tree_cpu_seconds(proc.pid) - server_cpu0) / n_posts,
            "postgres": 1e3 * postgres_cpu_since(database, pg_cpu0) / n_posts,
            "client": 1e3 * client_cpu_s / n_posts,
        }

        result = {
            "batch_traces_per_s": round(throughput, 1),
            "batch_traces": n_traces,
            "batch_size": args.batch_size,
            "concurrency": args.concurrency,
            "api_workers": args.workers,
            "batch_seconds": round(elapsed, 2),
            # CPU per 1,000 traces, robust to other load on the machine: the API process is
            # single-threaded Python (one core at most), PostgreSQL runs beside it.
            "api_cpu_ms_per_1000_traces": round(1e6 * server_cpu / n_traces, 1),
            "postgres_cpu_ms_per_1000_traces": round(1e6 * pg_cpu / n_traces, 1),
            "client_cpu_ms_per_1000_traces": round(1e6 * client_cpu / n_traces, 1),
            "load_average_1m": os.getloadavg()[0],
            "single_post_ms": {
                "p50": round(percentile(latencies, 50), 2),
                "p95": round(percentile(latencies, 95), 2),
                "p99": round(percentile(latencies, 99), 2),
                "n": len(latencies),
                "clients": n,
                "client": args.client,
                "posts_per_s": round(n_posts / single_elapsed, 1),
                "slowest_1pct_ms_at_s": slow_at,
                "cpu_ms_per_post": {k: round(v, 2) for k, v in single_cpu.items()},
            },
            "cpu_count": os.cpu_count(),
        }
        print(
            f"batch ingest: {n_traces} traces in {elapsed:.2f} s = {throughput:,.0f} traces/s "
            f"(batches of {args.batch_size}, {args.concurrency} client threads)"
        )
        print(
            f"CPU per 1,000 traces: API process {result['api_cpu_ms_per_1000_traces']} ms, "
            f"PostgreSQL {result['postgres_cpu_ms_per_1000_traces']} ms, "
            f"this client {result['client_cpu_ms_per_1000_traces']} ms "
            f"(load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)"
        )
        s = result["single_post_ms"]
        print(
            f"single POST latency over {s['n']} requests: "  # type: ignore[index]
            f"p50 {s['p50']} ms, p95 {s['p95']} ms, p99 {s['p99']} ms; "
            f"CPU per POST: API {single_cpu['api']:.2f} ms, "
            f"PostgreSQL {single_cpu['postgres']:.2f} ms, client {single_cpu['client']:.2f} ms "
            f"(load average {os.getloadavg()[0]:.2f})"
        )  # type: ignore[index]
        print(json.dumps(result))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        drop_database(server_url, database_url)


if __name__ == "__main__":
    random.seed(0)
    main()
