"""What the tests that run real `replay-audit worker` processes share: the worker's command and
environment, and a wait with a deadline. (The fixtures of such a run, `pg` and `api`, are in
tests/replays/conftest.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import RedisNamespace


def worker_env(pg: str, checkpoint: Path, redis: RedisNamespace) -> dict[str, str]:
    """A worker's environment: RQ on this test's Redis namespace, the database, the model
    directory, offline, one torch thread."""
    return {
        **os.environ,
        **redis.env(),
        "REPLAY_AUDIT_DATABASE_URL": pg,
        "REPLAY_AUDIT_RUNNER": "rq",
        "REPLAY_AUDIT_MODEL_DIRS": str(checkpoint),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def start_worker(env: dict[str, str], *args: str, burst: bool = False) -> subprocess.Popen[bytes]:
    """`replay-audit worker --queue gpu --device cpu ARGS` in its own process group: RQ forks a
    scheduler process beside the worker, and a SIGKILL of the group (as when a container dies)
    must not leave it behind."""
    cmd = [sys.executable, "-m", "replay_audit", "worker", "--queue", "gpu", "--device", "cpu"]
    cmd += [*args, *(["--burst"] if burst else [])]
    return subprocess.Popen(cmd, env=env, start_new_session=True)


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.1
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)
