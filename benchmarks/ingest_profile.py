"""Where a single POST /v1/traces spends its time, inside one API process, on PostgreSQL.

    .venv/bin/python benchmarks/ingest_profile.py [--posts 300] [--profile] [--top 40]

Builds the app as `serve` does (`create_app`) on a fresh PostgreSQL database (dropped
afterwards) and sends it `--posts` single POSTs of the benchmark's trace (`benchmarks/ingest.py`:
256 + 256 tokens, top-2), one after the other, straight through ASGI: no sockets, no client.
The endpoint's worker thread is run inline so that one profiler sees the whole request.
Reports, per POST and after 20 to warm up:

- CPU milliseconds of this process (the API's share; the thread hop is not in it), in the
  round (of `--rounds`) that took the least: other load on the machine only adds to it;
- PostgreSQL round trips (from libpq's protocol trace of 20 more POSTs: each time the client
  sends and then reads the answer), and the statements sent;
- with `--profile`, cProfile's functions by cumulative CPU time (call counts are exact; times
  are inflated by the profiler; waits on PostgreSQL are not in them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import os
import pstats
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio.to_thread
import numpy as np
import orjson
from sqlalchemy.orm import sessionmaker

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ingest import create_database, drop_database, make_trace  # noqa: E402

from replay_audit.api.app import create_app  # noqa: E402
from replay_audit.api.server import freeze_startup_objects  # noqa: E402
from replay_audit.auth.service import create_api_key  # noqa: E402
from replay_audit.config import Settings, normalise_database_url  # noqa: E402
from replay_audit.db import migration  # noqa: E402
from replay_audit.db.engine import create_db_engine  # noqa: E402
from replay_audit.db.unit_of_work import session_scope  # noqa: E402
from tests.round_trips import RoundTrips  # noqa: E402

WARM_UP = 20
#: POSTs sent on a traced connection, to count the round trips.
TRACED = 20


async def _inline(func: Any, *args: Any, **_: Any) -> Any:
    return func(*args)


async def post(app: Any, body: bytes, key: str) -> int:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/traces",
        "raw_path": b"/v1/traces",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-api-key", key.encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


_CLIENT = """
import http.client, sys, threading
port, key, path, threads = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
data = open(path, "rb").read()
bodies, at = [], 0
while at < len(data):
    size = int.from_bytes(data[at : at + 4], "little")
    bodies.append(data[at + 4 : at + 4 + size])
    at += 4 + size
import gc, time
gc.freeze()
times = []
start = time.perf_counter()
def send(share):
    connection = http.client.HTTPConnection("127.0.0.1", port)
    for body in share:
        headers = {"X-API-Key": key, "Content-Type": "application/json"}
        t0 = time.perf_counter()
        connection.request("POST", "/v1/traces", body, headers)
        answer = connection.getresponse()
        answer.read()
        times.append((1e3 * (time.perf_counter() - t0), t0 - start))
        assert answer.status == 201, answer.status
workers = [threading.Thread(target=send, args=(bodies[i::threads],)) for i in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
ms = sorted(t for t, _ in times)
pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]
slow = [(round(t, 1), round(at, 2)) for t, at in sorted(times, reverse=True)[:5]]
print(f"client: p50 {pick(0.5):.1f} ms, p99 {pick(0.99):.1f} ms, slowest (ms, at s) {slow}")
"""


class GcTimes:
    """The cyclic garbage collector's runs from now on, by generation: count, total and
    longest milliseconds (each run stops every thread of the process)."""

    def __init__(self) -> None:
        self.runs: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.runs[info["generation"]].append(1e3 * (time.perf_counter() - self._started))

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def __str__(self) -> str:
        return ", ".join(
            f"gen{g}: {len(r)} runs, {sum(r):.1f} ms, longest {max(r, default=0):.1f} ms"
            for g, r in self.runs.items()
        )


class ThreadProfiles:
    """cProfile in every thread started from now on (cProfile sees one thread only)."""

    def __init__(self) -> None:
        self.profiles: list[cProfile.Profile] = []
        threading.setprofile(self._start)

    def _start(self, *_: Any) -> None:
        sys.setprofile(None)
        profile = cProfile.Profile(time.thread_time)
        self.profiles.append(profile)
        profile.enable()

    def stats(self) -> pstats.Stats:
        threading.setprofile(None)  # type: ignore[arg-type]
        for profile in self.profiles:
            profile.disable()
            profile.create_stats()
        return pstats.Stats(*self.profiles)  # type: ignore[arg-type]


def serve_and_send(
    app: Any, warm: list[bytes], bodies: list[bytes], key: str, threads: int, profile: bool
) -> None:
    """Serve `app` with uvicorn (as `serve` does, one process) in a thread of this process and
    POST `bodies` to it from a client in another process: this process's CPU is the server's."""
    import uvicorn

    profiles = ThreadProfiles() if profile else None
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    with contextlib.ExitStack() as stack:
        files = []
        for part in (warm, bodies):
            file = stack.enter_context(tempfile.NamedTemporaryFile())
            for body in part:
                file.write(len(body).to_bytes(4, "little") + body)
            file.flush()
            files.append(file.name)
        command = [sys.executable, "-c", _CLIENT, str(port), key]
        subprocess.run([*command, files[0], str(threads)], check=True)
        collections = GcTimes()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        subprocess.run([*command, files[1], str(threads)], check=True)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        collections.stop()
    server.should_exit = True
    thread.join()
    n = len(bodies)
    print(
        f"{n} POSTs over HTTP from {threads} client threads: server CPU {1e3 * cpu / n:.2f} ms, "
        f"wall {1e3 * wall / n:.2f} ms per POST (load average {os.getloadavg()[0]:.2f})"
    )
    print(f"garbage collections: {collections}")
    if profiles is not None:
        stats = profiles.stats()
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server-url",
        default=os.environ.get(
            "REPLAY_AUDIT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument("--posts", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5, help="report the cheapest of these")
    parser.add_argument(
        "--http",
        type=int,
        metavar="THREADS",
        help="serve the app with uvicorn and POST over HTTP from THREADS client threads in "
        "another process instead (the CPU is then the whole server's)",
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--no-freeze",
        action="store_true",
        help="leave the startup objects to the garbage collector (`serve` freezes them)",
    )
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument(
        "--without",
        choices=["store", "parse+store"],
        help="replace the service call (and the body's validation) by a canned answer: what the "
        "rest of the request costs",
    )
    args = parser.parse_args()

    server_url = normalise_database_url(args.server_url)
    rng = np.random.default_rng(0)
    bodies = [orjson.dumps(make_trace(rng)) for _ in range(WARM_UP + args.posts + TRACED)]
    database_url = create_database(server_url)
    try:
        migration.upgrade(database_url)
        with session_scope(database_url) as session:
            key = create_api_key(session, "bench", "submitter").key
        app = create_app(Settings(_env_file=None, database_url=database_url))  # type: ignore[call-arg]
        if not args.no_freeze:
            freeze_startup_objects()  # as `serve` does
        if args.http:
            warm, measured = bodies[:WARM_UP], bodies[WARM_UP:]
            serve_and_send(app, warm, measured, key, args.http, args.profile)
            return
        anyio.to_thread.run_sync = _inline  # type: ignore[assignment]
        if args.without:
            from replay_audit.traces import endpoints, service
            from replay_audit.traces.schemas import IngestResult

            answer = IngestResult(index=0, status=201, id="tr_x", created=True)
            service.ingest_trace = lambda *a: answer  # type: ignore[assignment]
            if args.without == "parse+store":
                endpoints.parse_model = lambda *a: None  # type: ignore[assignment]
        traced = create_db_engine(database_url, pool_size=1)
        round_trips = RoundTrips(traced)
        n = args.posts
        warm, measured, counted = bodies[:WARM_UP], bodies[WARM_UP:-TRACED], bodies[-TRACED:]

        async def run() -> None:
            for body in warm:
                assert await post(app, body, key) == 201
            profiler = cProfile.Profile(time.process_time) if args.profile else None
            if profiler:
                profiler.enable()
            # The least CPU of a few rounds: other processes' load only ever adds to it.
            size = max(1, len(measured) // args.rounds)
            per_post: list[tuple[float, float]] = []
            for start in range(0, len(measured), size):
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for body in measured[start : start + size]:
                    assert await post(app, body, key) == 201
                done = len(measured[start : start + size])
                cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                per_post.append((cpu / done, wall / done))
            if profiler:
                profiler.disable()
            cpu, wall = min(per_post)
            # Then a few on an engine whose connections are traced (libpq writes every
            # message to a file: too slow for the CPU figures above).
            app.state.sessionmaker = sessionmaker(bind=traced, expire_on_commit=False)
            assert await post(app, warm[0], key) in (200, 201)  # connects; not counted
            round_trips.take()
            for body in counted:
                assert await post(app, body, key) == 201
            # (with --without nothing reaches the database: 0 round trips)
            trips, statements = round_trips.take()
            print(
                f"{n} POSTs: CPU {1e3 * cpu:.2f} ms, wall {1e3 * wall:.2f} ms per POST "
                f"(the round of {size} with the least CPU); "
                f"PostgreSQL round trips per POST: {trips / TRACED:.2f} "
                f"(load average {os.getloadavg()[0]:.2f})"
            )
            for statement, times in Counter(statements).most_common():
                print(f"  {times / TRACED:5.2f} x  {statement[:90]}")
            if profiler:
                stats = pstats.Stats(profiler)
                stats.sort_stats("cumulative").print_stats(args.top)
                stats.sort_stats("tottime").print_stats(args.top)

        asyncio.run(run())
    finally:
        drop_database(server_url, database_url)


if __name__ == "__main__":
    main()
