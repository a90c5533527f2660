"""`replay-audit worker`'s exit status tells a supervisor (systemd's `Restart=on-failure`,
compose's `restart: on-failure`) whether to start it again: 0 after a stop someone asked for
(SIGTERM, SIGINT: RQ's warm shutdown), non-zero when its work loop ended on its own because
Redis failed. Each test runs a real worker process against a redis-server of its own (a free
port, no persistence), which it may kill under the worker, and a SQLite database.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from rq import Queue
from rq import Worker as RQWorker
from rq.job import Job

from replay_audit.db import migration
from tests.conftest import REPO_ROOT
from tests.rq_workers import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.slow]

#: What the worker says when its work loop ended with no one asking it to stop.
UNASKED = "not asked to stop"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class OwnRedis:
    """A redis-server of this test's own on a free port, killed and started again at will."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.client = Redis.from_url(self.url)
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Start it (again: empty, as a restart without persistence leaves it)."""
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        wait_until(self._answers, 10, "redis-server to start", every_s=0.01)

    def _answers(self) -> bool:
        try:
            return bool(self.client.ping())
        except Exception:
            return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def redis_server() -> Iterator[OwnRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("needs the redis-server binary")
    server = OwnRedis()
    try:
        yield server
    finally:
        server.kill()


class Worker:
    """`replay-audit worker --queue cpu --device cpu` on `redis`, its stderr in a file."""

    def __init__(self, redis: OwnRedis, tmp_path: Path) -> None:
        url = f"sqlite:///{tmp_path / 'replay-audit.db'}"
        migration.upgrade(url)
        env = {
            **os.environ,
            "REPLAY_AUDIT_DATABASE_URL": url,
            "REPLAY_AUDIT_RUNNER": "rq",
            "REPLAY_AUDIT_REDIS_URL": redis.url,
            "REPLAY_AUDIT_QUEUE_PREFIX": "",
            "REPLAY_AUDIT_WORKER_METRICS_PORT": "0",
            "HF_HUB_OFFLINE": "1",
        }
        self.log = tmp_path / "worker.log"
        cmd = [sys.executable, "-m", "replay_audit", "worker", "--queue", "cpu", "--device", "cpu"]
        with self.log.open("wb") as err:
            self.process = subprocess.Popen(
                cmd, env=env, cwd=REPO_ROOT, stdout=err, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.queue = Queue("cpu", connection=redis.client)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def start_job(self, seconds: float) -> Job:
        """A job that sleeps `seconds`, once the worker has started it."""
        job = self.queue.enqueue("time.sleep", seconds)
        wait_until(lambda: job.get_status(refresh=True) == "started", 120, "the job to start")
        return job

    def idle(self) -> bool:
        """Whether the worker waits for a job (RQ's state `idle`)."""
        workers = RQWorker.all(connection=self.queue.connection)
        return any(w.get_state() == "idle" for w in workers)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the worker did not exit:\n{self.text()[-3000:]}") from None

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


@pytest.fixture
def worker(redis_server: OwnRedis, tmp_path: Path) -> Iterator[Worker]:
    w = Worker(redis_server, tmp_path)
    try:
        yield w
    finally:
        w.kill()


def test_a_worker_whose_redis_dies_exits_non_zero(worker: Worker, redis_server: OwnRedis) -> None:
    """Redis is killed mid-job and stays away: RQ's work loop gives up after the job, and the
    worker exits non-zero saying why."""
    worker.start_job(2)
    redis_server.kill()
    code = worker.wait(120)
    assert code != 0, worker.text()[-3000:]
    assert UNASKED in worker.text(), worker.text()[-3000:]


def test_a_worker_whose_redis_times_out_exits_non_zero(worker: Worker) -> None:
    """Redis does not answer the worker in time once, right after a job (the job itself
    makes the worker's next write raise redis' TimeoutError, `worker_faults`), and RQ's work
    loop returns on it ("Redis connection timeout, quitting"); its goodbye to Redis then goes
    through, as if it had been asked to stop. No one asked: the worker exits non-zero, so a
    supervisor restarting on failure starts it again."""
    job = worker.queue.enqueue("tests.cli.worker_faults.time_out_redis_after_this_job")
    code = worker.wait(120)
    assert job.get_status(refresh=True) == "finished"  # the fault came after it
    assert "Redis connection timeout" in worker.text(), worker.text()[-3000:]
    assert code != 0, worker.text()[-3000:]
    assert UNASKED in worker.text(), worker.text()[-3000:]


def test_an_idle_worker_outlives_a_redis_restart(worker: Worker, redis_server: OwnRedis) -> None:
    """A worker waiting for jobs waits out a Redis restart (RQ reconnects with a backoff): it
    does not exit, and takes the next job from the new Redis."""
    wait_until(worker.idle, 120, "the worker to wait for jobs")
    redis_server.kill()
    time.sleep(2)
    redis_server.start()
    job = worker.queue.enqueue("time.sleep", 0)
    wait_until(lambda: job.get_status(refresh=True) == "finished", 60, "the job after it")
    assert worker.process.poll() is None, worker.text()[-3000:]


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "mid-job"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_worker_asked_to_stop_exits_zero(worker: Worker, sig: int, busy: bool) -> None:
    """A stop someone asked for ends the worker with 0 (mid-job: after the job, RQ's warm
    shutdown), so a supervisor restarting on failure leaves it stopped."""
    if busy:
        job = worker.start_job(2)
    else:  # waiting for a job: RQ's signal handlers are in place
        wait_until(worker.idle, 120, "the worker to wait for jobs")
    os.kill(worker.process.pid, sig)
    assert worker.wait(60) == 0, worker.text()[-3000:]
    if busy:
        assert job.get_status(refresh=True) == "finished"
