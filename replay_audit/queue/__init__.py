"""Job queue: two runners behind one interface, running the same job functions.

The database is the source of truth; a runner only carries ids. Job functions are named by
dotted path (`"replay_audit.replays.tasks.run_replay_job"`), so the API process never imports
the code a worker runs (and with it torch). Enqueue only after the transaction that created the
rows has committed (see `replay_audit.db.unit_of_work`).

    InProcessRunner   embedded default: a background thread of this process, no Redis
    RQRunner          production: Redis + RQ workers (`replay-audit worker --queue gpu`)
"""

from replay_audit.queue.runner import (
    Capabilities,
    JobQueue,
    JobSpec,
    Runner,
    build_job_queue,
    build_runner,
    host_gpu_kind,
    long_job_spec,
    resolve,
    rq_name,
    stop_requested,
    stop_runner,
)

__all__ = [
    "Capabilities",
    "JobQueue",
    "JobSpec",
    "Runner",
    "build_job_queue",
    "build_runner",
    "host_gpu_kind",
    "long_job_spec",
    "resolve",
    "rq_name",
    "stop_requested",
    "stop_runner",
]
