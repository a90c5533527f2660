"""The reconciler: the database says which jobs are unfinished; make sure a runner holds each.

Redis may be flushed or lost, a worker may be SIGKILLed mid-job (RQ then still shows the job as
started), and the in-process runner forgets everything when its process stops. None of that
loses work, because the rows say what is left: a job not done whose runner does not hold it, or
whose heartbeat (`replay_jobs.updated_at`, touched after every trace) is older than
`stale_after_s`, is enqueued again. Under RQ a started job is held only while its worker is alive
(`queue.state.worker_alive`: a killed worker's job counts as lost `ALIVE_TTL_S`, 15 s, after its
death); `stale_after_s` is the backstop for a job no lease holds (docs/operations.md,
"Recovery"). A job whose lease lives (`db.job_row.leased`: its job runs, though Redis lost it)
is left alone, stale or not: it never runs twice at once. Running a job again after it
stopped is harmless (results are unique per trace x comparison), so erring towards
re-enqueueing is safe.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy.orm import Session

from replay_audit.db.base import utcnow
from replay_audit.db.job_row import lease_live
from replay_audit.queue import JobSpec, Runner
from replay_audit.replays import repository

log = logging.getLogger(__name__)


def job_spec(job_id: int, queue: str, timeout_s: int) -> JobSpec:
    """The one way a replay job is named and enqueued (the service and the reconciler)."""
    return JobSpec(
        func="replay_audit.replays.tasks.run_replay_job",
        args=(job_id,),
        job_id=f"replay-job-{job_id}",
        queue=queue,
        timeout_s=timeout_s,
    )


def reconcile(
    session: Session, runner: Runner, *, stale_after_s: float, job_timeout_s: int
) -> list[int]:
    """Re-enqueue unfinished jobs that no runner holds or whose heartbeat is stale; return
    their ids."""
    stale_before = utcnow() - timedelta(seconds=stale_after_s)
    again = []
    for job in repository.unfinished_jobs(session):
        spec = job_spec(job.id, job.queue, job_timeout_s)
        held = runner.is_queued(spec.job_id)
        stale = job.status == "running" and job.updated_at < stale_before
        if (held and not stale) or lease_live(job):  # a leased one runs: never twice at once
            continue
        log.warning(
            "re-enqueueing replay job %d (%s)", job.id, "stale heartbeat" if held else "lost"
        )
        job.updated_at = utcnow()
        runner.enqueue(spec)
        again.append(job.id)
    return again
