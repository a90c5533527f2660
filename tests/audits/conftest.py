"""Fixtures for audit schedules: the replay tests' fake engines and holding runner, a runner
that records alert deliveries, and helpers to place traces and schedules in time.

    def test_x(client, runner, alerts, headers, logged_trace, settings): ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import JSON, bindparam, select, text, update

from replay_audit.audits.models import AuditRun, AuditSchedule
from replay_audit.audits.tasks import TickReport, run_tick
from replay_audit.config import Settings
from replay_audit.db.unit_of_work import session_scope
from replay_audit.queue import JobSpec
from replay_audit.traces.models import Trace
from tests.replays.conftest import (  # noqa: F401  (fixtures used by the audit tests)
    HoldingRunner,
    fake_model_dir,
    ingest,
    logged_trace,
    worker_env,
)

#: Prompts the fake model (tests/replays/conftest.py) logs traces for.
PROMPTS = [[i, (i * 5) % 11, 3] for i in range(1, 25)]
FP16 = {"dtype": "fp16", "label": "FP16"}
FP16_C = {"dtype": "fp16", "intervention": {"kind": "C", "tau": 1e-3}, "label": "FP16 + C"}
REPLAY = {"targets": [FP16, FP16_C], "compare_with": "self"}


class RecordingRunner:
    """Holds job specs (alert deliveries) without running them; `drop()` forgets them, like a
    flushed Redis."""

    def __init__(self) -> None:
        self.specs: list[JobSpec] = []
        self.held: set[str] = set()

    def enqueue(self, spec: JobSpec) -> None:
        self.specs.append(spec)
        self.held.add(spec.job_id)

    def is_queued(self, job_id: str) -> bool:
        return job_id in self.held

    def ping(self) -> None:
        """Always takes work (the test runs it)."""

    def drop(self) -> None:
        self.held.clear()


@pytest.fixture
def runner(client: TestClient, worker_env: Any) -> HoldingRunner:  # noqa: F811
    """Replay jobs of the app (and of ticks given it) wait here until `run_all()`."""
    r = HoldingRunner()
    app_state = client.app.state  # type: ignore[attr-defined]
    app_state.queue = dataclasses.replace(app_state.queue, runner=r)
    return r


@pytest.fixture
def alerts() -> RecordingRunner:
    return RecordingRunner()


@pytest.fixture
def tick(
    settings: Settings, runner: HoldingRunner, alerts: RecordingRunner
) -> Callable[..., TickReport]:
    """tick(now=None) -> one scheduler pass with the holding runners."""

    def make(now: datetime | None = None) -> TickReport:
        return run_tick(settings, runner=runner, alert_runner=alerts, now=now)

    return make


def set_created_at(db_url: str, trace_ids: list[str], when: datetime) -> None:
    """Pretend the traces were logged at `when` (the sampling window reads created_at)."""
    with session_scope(db_url) as s:
        s.execute(update(Trace).where(Trace.public_id.in_(trace_ids)).values(created_at=when))


def set_active_since(db_url: str, schedule_id: str, when: datetime) -> None:
    """Pretend the schedule was created (or resumed) at `when`."""
    with session_scope(db_url) as s:
        s.execute(
            update(AuditSchedule)
            .where(AuditSchedule.public_id == schedule_id)
            .values(active_since=when, created_at=when)
        )


def schedule_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "nightly production",
        "selection": {"tags": ["production"], "window_hours": 24},
        "sample_size": 8,
        "policy": "uniform",
        "seed": 7,
        "replay": REPLAY,
    }
    return body | overrides


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


@pytest.fixture
def make_schedule(
    client: TestClient, headers: Callable[..., dict[str, str]]
) -> Callable[..., tuple[str, dict[str, str]]]:
    """make_schedule(**body overrides) -> (schedule id, admin headers)."""

    def make(**overrides: Any) -> tuple[str, dict[str, str]]:
        h = headers("admin")
        r = client.post("/v1/audits/schedules", json=schedule_body(**overrides), headers=h)
        assert r.status_code == 201, r.text
        return str(r.json()["id"]), h

    return make


def old_shape_metrics(n: int) -> dict[str, Any]:
    """A perfect night's trend point exactly as `drift.run_metrics` stored it before the
    metrics were typed (plain dicts; FP16, FP16 + C, self; `n` traces, all agreeing)."""
    cats = {"agreed": n, "head_reachable": 0, "kv_dependent": 0, "body_dominated": 0}
    labels = ["fp16", "fp16 + C(τ=0.001)", "self (logged configuration)"]
    comps = [
        {
            "index": i,
            "label": label,
            "self": i == 2,
            "intervention": "C" if i == 1 else "none",
            "n": n,
            "failed": 0,
            "ear": 1.0,
            "ear_low": 0.9,
            "ear_high": 1.0,
            "exact": n,
            "trigger_rate": 0.0,
            "categories": cats,
        }
        for i, label in enumerate(labels)
    ]
    return {
        "comparisons": comps,
        "ear": 1.0,
        "ear_low": 0.9,
        "ear_high": 1.0,
        "baseline": 0,
        "c_lift": {
            "lift": 0.0,
            "low": 0.0,
            "high": 0.0,
            "n": n,
            "fixed": 0,
            "broke": 0,
            "comparison": 1,
        },
        "trigger_rate": 0.0,
        "categories": cats,
        "self_agreement": 1.0,
    }


#: A flag as `drift.detect_drift` stored it before flags were typed (no test, no counts).
OLD_SHAPE_FLAG: dict[str, Any] = {
    "kind": "ear_drop",
    "comparison": 0,
    "label": "fp16",
    "ear": 0.9,
    "trailing_mean": 0.97,
    "trailing_runs": 3,
    "drop_points": 7.0,
    "message": "fp16: EAR 90.0% is 7.0 points below the 3-run mean 97.0%",
}


def add_old_shape_history(
    db_url: str, schedule_id: str, *, nights: int = 3, n: int = 40, flag_first: bool = False
) -> None:
    """`nights` evaluated perfect runs before the schedule's real ones, their metrics and flags
    written as raw JSON in the shape stored before they were typed (not through the typed
    column), as rows of an older release are."""
    raw = text("UPDATE audit_runs SET metrics = :metrics, flags = :flags WHERE id = :id")
    raw = raw.bindparams(bindparam("metrics", type_=JSON), bindparam("flags", type_=JSON))
    with session_scope(db_url) as s:
        schedule = s.scalar(select(AuditSchedule).where(AuditSchedule.public_id == schedule_id))
        assert schedule is not None
        for night in range(1, nights + 1):
            run = AuditRun(
                public_id=f"ar_old{schedule.id}_{night}",
                schedule_id=schedule.id,
                due_at=utc(2026, 1, night, 2),
                trigger="scheduled",
                status="done",
                window_start=utc(2026, 1, night),
                window_end=utc(2026, 1, night, 2),
                n_sampled=n,
                flags=[],
            )
            s.add(run)
            s.flush()
            flags = [OLD_SHAPE_FLAG] if flag_first and night == 1 else []
            s.execute(raw, {"metrics": old_shape_metrics(n), "flags": flags, "id": run.id})
