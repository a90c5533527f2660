"""The runners.

In-process: it stops; the running job sees `stop_requested()` and returns, nothing more runs,
and nobody waits forever on jobs that will never run here. Its jobs see the context its builder
bound (a worker context), and keep what they bind for the runner's next jobs, not for the
process. (A command stopping the runners it owns on Ctrl-C is tested through real processes in
tests/cli/test_interrupt.py.)

RQ: REPLAY_AUDIT_QUEUE_PREFIX keeps two deployments (or test runs) on one Redis apart.
"""

from __future__ import annotations

import threading
import time
from contextvars import ContextVar
from pathlib import Path

import pytest
from rq.job import Job, JobStatus

from replay_audit.queue import JobSpec, stop_requested
from replay_audit.queue.runner import InProcessRunner, RQRunner
from tests.cli.conftest import assert_no_traceback, cli_env, run_cli
from tests.conftest import RedisNamespace

started = threading.Event()
ran: list[str] = []


def long_job(name: str) -> None:
    """Works in small steps until its runner stops (at most 30 s)."""
    ran.append(name)
    started.set()
    deadline = time.monotonic() + 30
    while not stop_requested() and time.monotonic() < deadline:
        time.sleep(0.01)


def _spec(name: str) -> JobSpec:
    return JobSpec(func=f"{__name__}.long_job", args=(name,), job_id=name)


#: What the jobs below see of their runner's context.
seen: ContextVar[str | None] = ContextVar("test_runner_seen", default=None)
observed: list[str | None] = []


def observe(bind: str) -> None:
    """Record what the runner's context holds, then bind `bind` there for the next job."""
    observed.append(seen.get())
    seen.set(bind)


def test_jobs_run_in_a_copy_of_their_builders_context() -> None:
    observed.clear()
    token = seen.set("bound by the builder")
    try:
        runner = InProcessRunner()
    finally:
        seen.reset(token)
    other = InProcessRunner()  # built with nothing bound
    try:
        for n, r in enumerate((runner, runner, other)):
            r.enqueue(JobSpec(func=f"{__name__}.observe", args=(f"job {n}",), job_id=f"o{n}"))
            assert r.join(10)
    finally:
        assert runner.stop(10) and other.stop(10)
    # The builder's binding, then what the runner's first job bound; another runner sees none
    # of it, and neither does this thread.
    assert observed == ["bound by the builder", "job 0", None]
    assert seen.get() is None


def test_stop_ends_the_running_job_and_runs_nothing_more() -> None:
    started.clear()
    ran.clear()
    runner = InProcessRunner()
    runner.enqueue(_spec("first"))
    runner.enqueue(_spec("second"))
    assert started.wait(10)
    assert not stop_requested()  # only the runner's own thread is told

    t0 = time.monotonic()
    assert runner.stop(timeout_s=10)
    assert time.monotonic() - t0 < 5
    assert ran == ["first"]
    assert not runner.is_queued("second") and runner.join(timeout_s=1)

    runner.enqueue(_spec("third"))  # a stopped runner takes nothing more
    time.sleep(0.2)
    assert ran == ["first"] and not runner.is_queued("third")


@pytest.mark.redis
@pytest.mark.slow
def test_two_queue_prefixes_do_not_see_each_others_jobs(
    rq_redis: RedisNamespace, tmp_path: Path
) -> None:
    other = RedisNamespace(rq_redis.url, f"{rq_redis.prefix}other-", rq_redis.connection)
    try:
        mine = RQRunner(rq_redis.url, prefix=rq_redis.prefix)
        theirs = RQRunner(other.url, prefix=other.prefix)
        # The same piece of work (same job id, same queue) in both: two jobs, one each.
        spec = JobSpec(func="os.getpid", args=(), job_id="replay-job-1", queue="cpu")
        mine.enqueue(spec)
        assert mine.is_queued("replay-job-1") and not theirs.is_queued("replay-job-1")
        theirs.enqueue(spec)
        assert theirs.is_queued("replay-job-1")

        # A real worker of my namespace empties my queue and leaves theirs alone.
        env = cli_env(database_url=f"sqlite:///{tmp_path / 'w.db'}", runner="rq")
        env |= rq_redis.env()
        proc = run_cli(["worker", "--queue", "cpu", "--device", "cpu", "--burst"], env=env,
                       cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert_no_traceback(proc)
        c = rq_redis.connection
        mine_job = Job.fetch(f"{rq_redis.prefix}replay-job-1", connection=c)
        assert mine_job.get_status() == JobStatus.FINISHED and not mine.is_queued("replay-job-1")
        theirs_job = Job.fetch(f"{other.prefix}replay-job-1", connection=c)
        assert theirs_job.get_status() == JobStatus.QUEUED and theirs.is_queued("replay-job-1")

        # Flushing their namespace leaves mine.
        other.flush()
        assert not theirs.is_queued("replay-job-1")
        assert Job.exists(f"{rq_redis.prefix}replay-job-1", connection=c)
    finally:
        other.flush()
