"""Exactly one run per schedule per due time with several schedulers at once: threads racing
on one database (each its own connection and transaction), and two `replay-audit audit tick`
processes against the real PostgreSQL. The unique (schedule, due time) key decides."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from replay_audit.audits import repository, service
from replay_audit.audits.models import AuditRun, AuditSchedule
from replay_audit.audits.tasks import run_tick
from replay_audit.config import Settings
from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope
from replay_audit.queue import Capabilities, JobQueue
from replay_audit.replays.models import ReplayRun
from replay_audit.replays.service import RunDefaults
from tests.audits.conftest import (
    PROMPTS,
    HoldingRunner,
    RecordingRunner,
    ingest,
    set_created_at,
    utc,
)

MakeSchedule = Callable[..., tuple[str, dict[str, str]]]


def _counts(db_url: str) -> tuple[int, int, int]:
    with session_scope(db_url) as s:
        runs = s.scalar(select(func.count()).select_from(AuditRun)) or 0
        dues = s.scalar(select(func.count(func.distinct(AuditRun.due_at)))) or 0
        replays = s.scalar(select(func.count()).select_from(ReplayRun)) or 0
    return runs, dues, replays


def _race(n: int, fn: Callable[[], Any]) -> list[Any]:
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def go(i: int) -> None:
        try:
            barrier.wait(10)
            results[i] = fn()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_racing_claims_make_one_run(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four transactions claim the same due time at once; the first to insert holds its row
    while it samples (slowed down here), the others meet the unique key and get its run."""
    sid, h = make_schedule()
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:10]])
    due = utc(2030, 1, 15, 2)
    set_created_at(db_url, ids, due - timedelta(hours=1))
    slow_count = repository.count_candidates

    def count_slowly(*args: Any, **kwargs: Any) -> int:
        time.sleep(0.3)  # hold the uncommitted claim while the others try theirs
        return slow_count(*args, **kwargs)

    monkeypatch.setattr(repository, "count_candidates", count_slowly)

    def claim() -> tuple[str, bool]:
        with session_scope(db_url) as s:
            schedule = s.scalar(select(AuditSchedule).where(AuditSchedule.public_id == sid))
            assert schedule is not None
            run, created = service.start_audit_run(
                s,
                schedule,
                due,
                "scheduled",
                queue=JobQueue(runner, 60, Capabilities("inprocess", cuda=False)),
                defaults=RunDefaults(),
            )
            return run.public_id, created

    results = _race(4, claim)
    assert sorted(created for _, created in results) == [False, False, False, True]
    assert len({public_id for public_id, _ in results}) == 1
    assert _counts(db_url) == (1, 1, 1)
    assert len(runner.specs) == 1  # one replay job enqueued, after the one commit


def test_racing_ticks_start_each_due_time_once(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    settings: Settings,
    db_url: str,
) -> None:
    """Three schedules, four schedulers ticking at the same instant, twice."""
    for i in range(3):
        make_schedule(name=f"s{i}", seed=i)
    h = make_schedule(name="empty", selection={"model_name": "nobody"})[1]
    with session_scope(db_url) as s:
        s.execute(AuditSchedule.__table__.update().values(active_since=utc(2030, 1, 1)))
    ids = ingest(client, h, [logged_trace(p) for p in PROMPTS[:10]])
    set_created_at(db_url, ids, utc(2030, 1, 15, 1))
    now = utc(2030, 1, 15, 2, 0, 3)
    reports = _race(
        4, lambda: run_tick(settings, runner=runner, alert_runner=RecordingRunner(), now=now)
    )
    assert sum(r.started for r in reports) == 4 and sum(r.errors for r in reports) == 0
    reports = _race(
        4, lambda: run_tick(settings, runner=runner, alert_runner=RecordingRunner(), now=now)
    )
    assert sum(r.started for r in reports) == 0
    runs, dues, replays = _counts(db_url)
    assert (runs, dues, replays) == (4, 1, 3)  # the empty schedule's run has no replay run
    with session_scope(db_url) as s:
        per_schedule = s.execute(
            select(AuditRun.schedule_id, func.count()).group_by(AuditRun.schedule_id)
        ).all()
    assert sorted(n for _, n in per_schedule) == [1, 1, 1, 1]


@pytest.mark.postgres
@pytest.mark.slow
def test_two_scheduler_processes_on_postgres(postgres_database_url: str) -> None:
    """Two `replay-audit audit tick` processes at once against the real PostgreSQL."""
    from replay_audit.audits.schemas import ScheduleCreate
    from replay_audit.auth.service import create_api_key
    from tests.conftest import empty_all_tables

    url = postgres_database_url
    try:
        with session_scope(url) as s:
            project = create_api_key(s, "acme", "admin").api_key.project_id
            for i in range(5):
                body = ScheduleCreate.model_validate(
                    {
                        "name": f"hourly {i}",
                        "cron": "0 * * * *",
                        "selection": {"model_name": "nobody"},  # no traces: no replay jobs
                        "replay": {"compare_with": "self"},
                    }
                )
                hour = utcnow().replace(minute=0, second=0, microsecond=0)
                service.create_schedule(
                    s,
                    project,
                    body,
                    capabilities=Capabilities("inprocess", cuda=False),
                    now=hour - timedelta(minutes=1),
                )
        env = {**os.environ, "REPLAY_AUDIT_DATABASE_URL": url, "REPLAY_AUDIT_RUNNER": "inprocess"}
        cmd = [sys.executable, "-m", "replay_audit", "audit", "tick"]
        procs = [
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        started = [int(o.split("started ")[1].split(",")[0]) for o in outs]
        runs, _, _ = _counts(url)
        with session_scope(url) as s:
            pairs = s.execute(select(AuditRun.schedule_id, AuditRun.due_at)).all()
        assert len(pairs) == len(set(pairs)) == sum(started)
        assert runs >= 5 and sum(started) == runs  # every claim won exactly once
    finally:
        empty_all_tables(url)
