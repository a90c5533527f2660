"""Screenings the database says are unfinished but no runner holds (a Redis flush, a worker
killed mid-screening: its heartbeat, `screenings.updated_at`, goes stale) are enqueued again.
One whose lease lives (`db.job_row.leased`: its job runs, though Redis lost it) is left alone.
Running a screening again is harmless: it resumes from its stored outputs."""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy.orm import Session

from replay_audit.db import jobs
from replay_audit.db.base import utcnow
from replay_audit.db.job_row import lease_live
from replay_audit.queue import Runner
from replay_audit.screenings.models import Screening
from replay_audit.screenings.service import job_spec

log = logging.getLogger(__name__)


def reconcile_screenings(
    session: Session,
    runner: Runner,
    *,
    stale_after_s: float,
    job_timeout_s: int,
    default_queue: str = "gpu",
) -> list[int]:
    """Re-enqueue unfinished screenings that no runner holds or whose heartbeat is stale;
    return their ids."""
    stale_before = utcnow() - timedelta(seconds=stale_after_s)
    again = []
    for row in jobs.unfinished(Screening, session):
        spec = job_spec(row, job_timeout_s, default_queue)
        held = runner.is_queued(spec.job_id)
        stale = row.status == "running" and row.updated_at < stale_before
        if (held and not stale) or lease_live(row):  # a leased one runs: never twice at once
            continue
        log.warning("re-enqueueing screening %d (%s)", row.id, "stale" if held else "lost")
        row.updated_at = utcnow()
        runner.enqueue(spec)
        again.append(row.id)
    return again
