"""Verifications the database says are unfinished but no runner holds (a Redis flush, a worker
killed mid-verification: under RQ its started job counts as held only while the worker's
liveness key lives, `queue.state.worker_alive`) are enqueued again.

A held verification (queued, waiting for a retry, or started by a live worker) or one whose
lease lives (`db.job_row.leased`: its job runs, though Redis lost it) is never enqueued again:
it would run twice at once. There is no heartbeat to call one stale: a job that hangs is
ended by its own timeout (`REPLAY_AUDIT_JOB_TIMEOUT_S`), and a pass after that takes it.
Running one again is harmless: the job starts one more attempt on the row
(`db.job_row.claim_attempt`), reuses the calibrations an earlier attempt stored and writes the
one report of the row.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from replay_audit.db.job_row import lease_live
from replay_audit.queue import Runner
from replay_audit.verifications import repository
from replay_audit.verifications.service import job_spec

log = logging.getLogger(__name__)


def reconcile_verifications(
    session: Session, runner: Runner, *, job_timeout_s: int, default_queue: str = "gpu"
) -> list[int]:
    """Re-enqueue unfinished verifications that no runner holds; return their ids."""
    again = []
    for row in repository.unfinished(session):
        spec = job_spec(row, job_timeout_s, default_queue)
        if runner.is_queued(spec.job_id) or lease_live(row):  # a leased one runs elsewhere
            continue
        log.warning("re-enqueueing verification %d (%s, lost)", row.id, row.status)
        runner.enqueue(spec)
        again.append(row.id)
    return again
