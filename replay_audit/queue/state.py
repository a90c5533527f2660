"""What RQ's registries say about a deployment's queues and workers, for `/metrics` and
`/readyz`: each queue's depth, running jobs and the age of its oldest waiting job, and the live
workers per GPU kind.

RQ knows a worker's queues but not its device, so `replay-audit worker` records its GPU kind
under `WORKER_KINDS` (a Redis hash: worker name -> GPU kind) when it starts and removes it when
it stops. A worker is live while RQ's worker registry holds it (its heartbeat keeps it there);
one killed without its goodbye leaves an entry in the hash that no live worker reads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from redis import Redis

#: The Redis hash of worker name -> GPU kind (after the deployment's queue prefix).
WORKER_KINDS: Final = "replay-audit:worker-gpu-kind"
#: The GPU kind of a live worker that recorded none (an `rq worker` started by hand).
UNKNOWN_KIND: Final = "unknown"


@dataclass(frozen=True)
class QueueState:
    #: The queue's name without the deployment's prefix (`gpu`, `cpu`, `audit`).
    name: str
    #: Jobs waiting.
    depth: int
    #: Jobs a worker is running.
    running: int
    #: Seconds the oldest waiting job has waited (None: none waits).
    oldest_age_s: float | None


def queue_states(connection: Redis, prefix: str, names: Sequence[str]) -> list[QueueState]:
    """The state of each queue of `names` (RedisError when Redis does not answer)."""
    from rq import Queue
    from rq.job import Job

    now = datetime.now(UTC)
    out = []
    for name in names:
        queue = Queue(prefix + name, connection=connection)
        oldest_age_s = None
        first = queue.get_job_ids(0, 1)  # the head of the queue: the oldest enqueued
        job = Job.fetch(first[0], connection=connection) if first else None
        if job is not None and job.enqueued_at is not None:
            enqueued = job.enqueued_at
            enqueued = enqueued if enqueued.tzinfo else enqueued.replace(tzinfo=UTC)
            oldest_age_s = max(0.0, (now - enqueued).total_seconds())
        out.append(QueueState(name, queue.count, queue.started_job_registry.count, oldest_age_s))
    return out


def live_workers(connection: Redis, prefix: str) -> dict[str, int]:
    """Live workers serving a queue of this deployment (its prefix), counted by GPU kind."""
    from rq import Worker

    workers = [
        w
        for w in Worker.all(connection=connection)
        if any(q.startswith(prefix) for q in w.queue_names())
    ]
    kinds = connection.hmget(prefix + WORKER_KINDS, [w.name for w in workers]) if workers else []
    return dict(Counter(k.decode() if isinstance(k, bytes) else UNKNOWN_KIND for k in kinds))


def record_worker_kind(connection: Redis, prefix: str, worker_name: str, gpu_kind: str) -> None:
    """Say which GPU kind worker `worker_name` runs on (`forget_worker` at its exit)."""
    connection.hset(prefix + WORKER_KINDS, worker_name, gpu_kind)


def forget_worker(connection: Redis, prefix: str, worker_name: str) -> None:
    connection.hdel(prefix + WORKER_KINDS, worker_name)
