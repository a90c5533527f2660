"""The embedded scheduler (a thread of `serve`, no Redis) and the `replay-audit audit` CLI."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from replay_audit.audits.models import AuditRun
from replay_audit.audits.scheduler import (
    InProcessScheduler,
    start_inprocess_scheduler,
    wants_inprocess_scheduler,
)
from replay_audit.cli import app as cli
from replay_audit.config import Settings
from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope
from replay_audit.queue import JobSpec
from replay_audit.queue.runner import InProcessRunner
from tests.audits.conftest import (
    PROMPTS,
    RecordingRunner,
    ingest,
    set_active_since,
    set_created_at,
)
from tests.conftest import REDIS_URL

MakeSchedule = Callable[..., tuple[str, dict[str, str]]]


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("scheduler", "runner", "wanted"),
    [
        ("auto", "inprocess", True),
        ("auto", "rq", False),  # production: `rq cron` does it
        ("off", "inprocess", False),
        ("inprocess", "rq", True),
    ],
)
def test_which_processes_run_the_embedded_scheduler(
    make_settings: Callable[..., Settings], scheduler: str, runner: str, wanted: bool
) -> None:
    assert wants_inprocess_scheduler(make_settings(scheduler=scheduler, runner=runner)) is wanted


def noop() -> None:
    """A job that does nothing."""


def _noop_spec(job_id: str) -> JobSpec:
    return JobSpec(func=f"{__name__}.noop", args=(), job_id=job_id)


def test_a_started_scheduler_is_its_callers(make_settings: Callable[..., Settings]) -> None:
    """Nothing process-wide keeps it: each call starts one, the caller stops it, and it stops
    the runners it built itself but not the one it was given."""
    assert start_inprocess_scheduler(make_settings(scheduler="off")) is None
    settings = make_settings(audit_tick_interval_s=3600)
    given = InProcessRunner()
    first = start_inprocess_scheduler(settings, runner=given)
    try:
        assert first is not None and first.running and first.runner is given
        _wait(lambda: first.ticks >= 1, 10, "the first tick")  # it ticks at once
        second = start_inprocess_scheduler(settings)
        assert second is not None and second is not first and second.runner is not given
        assert second.stop() and not second.running
    finally:
        assert first is not None
        first.stop()
    assert not first.running
    own_alerts = first.alerts
    assert isinstance(own_alerts, InProcessRunner)
    own_alerts.enqueue(_noop_spec("after-stop"))  # the runner it built is stopped: no taker
    assert not own_alerts.is_queued("after-stop")
    given.enqueue(_noop_spec("still-taken"))  # the caller's runner still takes work
    assert given.join(10) and given.stop(10)


def test_embedded_scheduler_runs_a_due_audit_end_to_end(
    client: TestClient,
    worker_env: Any,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    settings: Settings,
    db_url: str,
) -> None:
    """An hourly schedule that became active a minute before this hour: the thread starts the
    hour's run, the in-process runner replays it, a later tick evaluates it."""
    sid, h = make_schedule(cron="0 * * * *")
    hour = utcnow().replace(minute=0, second=0, microsecond=0)
    set_active_since(db_url, sid, hour - timedelta(minutes=1))
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:6]])
    set_created_at(db_url, ids, hour - timedelta(minutes=30))

    def run() -> AuditRun | None:
        with session_scope(db_url) as s:
            return s.scalar(select(AuditRun))

    sched = InProcessScheduler(
        settings, runner=InProcessRunner(), alerts=RecordingRunner(), interval_s=0.2
    ).start()
    try:
        _wait(lambda: (r := run()) is not None and r.status == "done", 60, "an evaluated run")
    finally:
        sched.stop()
    r = run()
    assert r is not None and r.due_at == hour and r.trigger == "scheduled"
    assert r.n_sampled == 6 and r.metrics is not None and r.metrics.self_agreement == 1.0
    assert sched.ticks >= 2
    with session_scope(db_url) as s:
        assert len(list(s.scalars(select(AuditRun)))) == 1  # many ticks, one run


@pytest.fixture
def cli_env(worker_env: Any) -> Iterator[None]:
    """The CLI reads REPLAY_AUDIT_DATABASE_URL (set by worker_env) and uses the fake engines.
    The settings cache is cleared so the CLI reads this test's database, not the last one's."""
    yield


def test_cli_list_run_now_trend_and_catch_up(
    client: TestClient,
    cli_env: None,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
) -> None:
    sid, h = make_schedule(name="cli nightly")
    ingest(client, h, [logged_trace(p) for p in PROMPTS[:10]])
    runner = CliRunner()

    wide = {"COLUMNS": None}  # piped and no COLUMNS: wide enough not to wrap a row
    listed = runner.invoke(cli, ["audit", "list", "--project", "acme"], env=wide)
    assert listed.exit_code == 0, listed.output
    assert sid in listed.output and "cli nightly" in listed.output

    # The embedded runner replays in this process and the command waits for the result.
    done = runner.invoke(cli, ["audit", "run-now", "--schedule", sid])
    assert done.exit_code == 0, done.output
    assert "manual  done" in done.output and "sampled 8/10" in done.output
    assert "self 100.0%" in done.output
    with session_scope(db_url) as s:
        run = s.scalar(select(AuditRun))
        assert run is not None and run.status == "done" and run.metrics is not None

    trend = runner.invoke(cli, ["audit", "trend", "--schedule", sid], env=wide)
    assert trend.exit_code == 0 and "done" in trend.output and "100.0%" in trend.output

    # A narrow terminal's width is kept when the output is not a terminal too (COLUMNS=80:
    # the tables were drawn 200 wide), the schedule id still whole (issue 33).
    for args in (["audit", "list", "--project", "acme"], ["audit", "trend", "--schedule", sid]):
        narrow = runner.invoke(cli, args, env={"COLUMNS": "80"})
        assert narrow.exit_code == 0, narrow.output
        assert max(len(line) for line in narrow.output.splitlines()) <= 80, narrow.output
        assert "\u2026" not in narrow.output  # wrapped, not cut to an ellipsis
    assert sid in runner.invoke(cli, ["audit", "list"], env={"COLUMNS": "80"}).output

    caught = runner.invoke(cli, ["audit", "catch-up", "--schedule", sid])
    assert caught.exit_code == 0 and "no missed runs" in caught.output

    missing = runner.invoke(cli, ["audit", "run-now", "--schedule", "as_nope"])
    assert missing.exit_code == 2 and "no audit schedule" in missing.output


def test_rq_cron_config_registers_the_tick_by_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `rq cron replay_audit.audits.cron_config` loads: the tick on the audit queue every
    30 s by interval (not a cron expression, which RQ would read in local time)."""
    from redis import Redis
    from rq.cron import CronScheduler

    monkeypatch.delenv("REPLAY_AUDIT_AUDIT_TICK_INTERVAL_S", raising=False)
    cron = CronScheduler(connection=Redis.from_url(REDIS_URL))
    cron.load_config_from_file("replay_audit.audits.cron_config")
    [job] = cron.get_jobs()
    assert job.func_name == "replay_audit.audits.tasks.tick"
    assert (job.queue_name, job.interval, job.cron) == ("audit", 30, None)
    assert job.name == "replay-audit-tick" and job.job_options["ttl"] >= 60

    # A deployment with REPLAY_AUDIT_QUEUE_PREFIX: the queue and the cron job carry it.
    monkeypatch.setenv("REPLAY_AUDIT_QUEUE_PREFIX", "staging-")
    cron = CronScheduler(connection=Redis.from_url(REDIS_URL))
    cron.load_config_from_file("replay_audit.audits.cron_config")
    [job] = cron.get_jobs()
    assert (job.queue_name, job.name) == ("staging-audit", "staging-replay-audit-tick")
