"""`replay-audit worker --processes K`: K worker processes on one device, supervised by one. Each
takes jobs of its own; a stop asked of the supervisor stops them all (exit 0); a process dying
unasked stops the others and the group exits non-zero (a supervisor restarting on failure starts
it again); `--burst` drains and exits 0. The group's metrics are every process's, added up, on
its one port. The tests run a real group against a redis-server of their own, as
tests/cli/test_worker_exit.py does for one worker.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from rq import Queue
from rq import Worker as RQWorker
from rq.job import Job

from replay_audit.cli.worker import _uses_cuda
from replay_audit.cli.worker_group import (
    CPU_WORKER_PROCESSES,
    GPU_WORKER_PROCESSES,
    default_processes,
    member_argv,
    member_env,
)
from replay_audit.config import Settings
from replay_audit.db import migration
from tests.cli.test_worker_exit import OwnRedis, _free_port, redis_server  # noqa: F401 (fixture)
from tests.conftest import REPO_ROOT
from tests.rq_workers import wait_until

#: The group's RQ name: its processes are g-1, g-2.
NAME = "g"


class Group:
    """`replay-audit worker --queue cpu --device cpu --processes 2 --name g [ARGS]` on `redis`,
    its output (the supervisor's and the processes') in one file."""

    def __init__(self, redis: OwnRedis, tmp_path: Path, *args: str) -> None:
        url = f"sqlite:///{tmp_path / 'replay-audit.db'}"
        migration.upgrade(url)
        self.metrics_port = _free_port()
        self.api_metrics = tmp_path / "api-metrics"
        self.api_metrics.mkdir(exist_ok=True)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("REPLAY_AUDIT_")},
            "REPLAY_AUDIT_DATABASE_URL": url,
            "REPLAY_AUDIT_RUNNER": "rq",
            "REPLAY_AUDIT_REDIS_URL": redis.url,
            "REPLAY_AUDIT_WORKER_METRICS_PORT": str(self.metrics_port),
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            # An API's multiprocess directory, inherited: the group must count elsewhere.
            "PROMETHEUS_MULTIPROC_DIR": str(self.api_metrics),
        }
        self.log = tmp_path / "group.log"
        cmd = [sys.executable, "-m", "replay_audit", "worker", "--queue", "cpu", "--device", "cpu"]
        cmd += ["--processes", "2", "--name", NAME, *args]
        self.queue = Queue("cpu", connection=redis.client)
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                cmd, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def members(self) -> dict[str, int]:
        """RQ name -> pid of the group's live workers."""
        workers = RQWorker.all(connection=self.queue.connection)
        return {w.name: int(w.pid) for w in workers if w.name.startswith(f"{NAME}-")}

    def idle(self) -> bool:
        workers = RQWorker.all(connection=self.queue.connection)
        return sum(w.get_state() == "idle" for w in workers if w.name.startswith(NAME)) == 2

    def wait(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the group did not exit:\n{self.text()[-4000:]}") from None

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # its processes share its group
            self.process.wait(10)


@pytest.fixture
def start_group(
    redis_server: OwnRedis,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> Iterator[Callable[..., Group]]:
    """Starts a group with extra options; kills what is left of it after the test."""
    groups: list[Group] = []

    def start(*args: str) -> Group:
        groups.append(Group(redis_server, tmp_path, *args))
        return groups[-1]

    try:
        yield start
    finally:
        for g in groups:
            g.kill()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _started(job: Job) -> bool:
    return job.get_status(refresh=True) == "started"


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize("everyone", [False, True], ids=["supervisor", "process-group"])
def test_two_processes_take_jobs_side_by_side_and_a_sigterm_stops_both(
    start_group: Callable[..., Group], everyone: bool
) -> None:
    """Two jobs run at once, one in each process (each its own pid, not the supervisor's); the
    group's metrics port counts both; SIGTERM of the supervisor mid-job stops both after their
    jobs (RQ's warm shutdown) and the group exits 0. So does a SIGTERM that reaches every
    process as well as the supervisor (systemd's default stop, a terminal's Ctrl-C): the copy
    the supervisor passes on is no second, cold, shutdown."""
    group = start_group()
    wait_until(group.idle, 120, "both processes to wait for jobs")
    members = group.members()
    assert set(members) == {"g-1", "g-2"}
    assert len({*members.values(), group.process.pid}) == 3
    jobs = [group.queue.enqueue("time.sleep", 5) for _ in range(2)]
    wait_until(lambda: all(_started(j) for j in jobs), 60, "both jobs to run at once")
    assert {j.worker_name for j in (Job.fetch(j.id, group.queue.connection) for j in jobs)} == {
        "g-1",
        "g-2",
    }
    metrics = httpx.get(f"http://127.0.0.1:{group.metrics_port}/metrics").text
    assert 'replay_audit_jobs_started_total{gpu_kind="cpu",kind="sleep"} 2.0' in metrics
    # Not in an inherited directory (where only the supervisor, a process that counts nothing,
    # left its empty files: prometheus-client reads the variable when the CLI imports it).
    inherited = {f.stem.rpartition("_")[2] for f in group.api_metrics.iterdir()}
    assert inherited <= {str(group.process.pid)}
    if everyone:
        os.killpg(group.process.pid, signal.SIGTERM)
    else:
        os.kill(group.process.pid, signal.SIGTERM)
    assert group.wait(60) == 0, group.text()[-4000:]
    assert [j.get_status(refresh=True) for j in jobs] == ["finished", "finished"]
    assert "cold shut down" not in group.text()
    assert all(_gone(pid) for pid in members.values())
    text = group.text()
    for i in (1, 2):  # every line of a process says which it is
        assert f"[process {i}/2] Worker g-{i}: started with PID {members[f'g-{i}']}" in text
        assert re.search(rf"process {i}/2 \(pid {members[f'g-{i}']}\) exited 0", text), text


@pytest.mark.redis
@pytest.mark.slow
def test_a_process_killed_stops_the_other_and_the_group_exits_non_zero(
    start_group: Callable[..., Group],
) -> None:
    """One process is SIGKILLed while the other runs a job: the supervisor restarts nothing, it
    stops the other after its job and exits non-zero, for its own supervisor to start the group
    again."""
    group = start_group()
    wait_until(group.idle, 120, "both processes to wait for jobs")
    members = group.members()
    job = group.queue.enqueue("time.sleep", 3)
    wait_until(lambda: _started(job), 60, "the job to start")
    busy = Job.fetch(job.id, group.queue.connection).worker_name
    (other,) = set(members) - {busy}
    os.kill(members[other], signal.SIGKILL)
    assert group.wait(60) != 0, group.text()[-4000:]
    assert job.get_status(refresh=True) == "finished"  # stopped warm, after its job
    assert _gone(members[busy])
    assert "not asked to stop" in group.text()


@pytest.mark.redis
@pytest.mark.slow
def test_a_burst_group_drains_the_queue_and_exits_zero(
    start_group: Callable[..., Group],
    redis_server: OwnRedis,  # noqa: F811 (the fixture)
) -> None:
    """--burst: each process exits 0 once the queue is empty, and the group exits 0 when both
    have."""
    queue = Queue("cpu", connection=redis_server.client)
    jobs = [queue.enqueue("time.sleep", 0.5) for _ in range(4)]
    group = start_group("--burst")
    assert group.wait(120) == 0, group.text()[-4000:]
    assert [j.get_status(refresh=True) for j in jobs] == ["finished"] * 4
    assert group.members() == {}
    for i in (1, 2):
        assert re.search(rf"process {i}/2 \(pid \d+\) exited 0", group.text())


def test_the_measured_defaults() -> None:
    """2 processes for a GPU worker of one device, 1 for a CPU worker or a tensor-parallel one;
    REPLAY_AUDIT_WORKER_PROCESSES unset by default, a whole number of 1 or more."""
    assert (GPU_WORKER_PROCESSES, CPU_WORKER_PROCESSES) == (2, 1)
    assert default_processes(gpu=True, devices=1) == 2
    assert default_processes(gpu=True, devices=2) == 1
    assert default_processes(gpu=False, devices=1) == 1
    assert Settings().worker_processes is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REPLAY_AUDIT_WORKER_PROCESSES", "4")
        assert Settings().worker_processes == 4
        mp.setenv("REPLAY_AUDIT_WORKER_PROCESSES", "0")
        with pytest.raises(ValueError, match="greater than or equal to 1"):
            Settings()
    assert _uses_cuda("cuda:1") and _uses_cuda("cuda") and not _uses_cuda("cpu")


def test_each_process_gets_its_name_place_and_share_of_the_cores() -> None:
    argv = member_argv(["--queue=cpu", "--device=cpu"], 2, 3, "w")
    assert argv == [
        "--queue=cpu", "--device=cpu", "--processes", "1", "--metrics-port", "0",
        "--member", "2/3", "--name", "w-2",
    ]  # fmt: skip
    assert "--name" not in member_argv([], 1, 2, None)  # RQ names each
    cores = os.cpu_count() or 1
    assert member_env({}, 2, gpu=False, torch_threads=None) == {
        "REPLAY_AUDIT_TORCH_THREADS": str(max(1, cores // 2))
    }
    assert member_env({}, 2, gpu=False, torch_threads=3) == {}  # set: each process takes it
    assert member_env({}, 2, gpu=True, torch_threads=None) == {}  # as measured


def test_a_json_log_line_says_which_process() -> None:
    import json
    import logging

    from replay_audit.telemetry.log import JsonFormatter

    record = logging.LogRecord("rq.worker", logging.INFO, __file__, 1, "started", None, None)
    assert json.loads(JsonFormatter("2/4").format(record))["process"] == "2/4"
    assert "process" not in json.loads(JsonFormatter().format(record))
