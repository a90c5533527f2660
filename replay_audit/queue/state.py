"""What RQ's registries say about a deployment's queues and workers, for `/metrics` and
`/readyz`: each queue's depth, running jobs and the age of its oldest waiting job, and the live
workers per GPU kind.

RQ knows a worker's queues but not its device, so `replay-audit worker` announces what it runs
on under `WORKER_KINDS` (a Redis hash: worker name -> `route.WorkerKind` as JSON: GPU kind, GPU
name, compute capability, devices) when it starts and removes it when it stops. A worker is
live while RQ's worker registry holds it (its heartbeat keeps it there); one killed without its
goodbye leaves an entry in the hash that no live worker reads. A Redis restarted without
persistence loses both records: the worker writes them again within `ALIVE_REFRESH_S` (its
liveness key found gone, `keep_alive`).

Liveness: RQ's own worker key is no help in telling a dead worker from a busy one, since a
SimpleWorker sends no heartbeat while a job runs (it sets its key's TTL to the job's timeout +
60 s when the job starts). So `replay-audit worker` keeps its own key, `WORKER_ALIVE` + name,
refreshed every `ALIVE_REFRESH_S` by a daemon thread with a TTL of `ALIVE_TTL_S`: it is gone
at most `ALIVE_TTL_S` seconds after the process dies, however it died (SIGKILL, OOM killer,
a lost host), and the reconciler then takes its started job as lost (`worker_alive`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Final

from redis import Redis

from replay_audit.queue.route import LiveWorker, WorkerKind

if TYPE_CHECKING:
    from rq import Worker

#: The Redis hash of worker name -> its `WorkerKind` JSON (after the deployment's queue prefix).
WORKER_KINDS: Final = "replay-audit:worker-gpu-kind"
#: The key (after the deployment's queue prefix and before the worker's name) that says a
#: `replay-audit worker` is alive.
WORKER_ALIVE: Final = "replay-audit:worker-alive:"
#: Seconds a worker's liveness key outlives its last refresh: how long after a worker's death
#: its started job still counts as held.
ALIVE_TTL_S: Final = 15
#: Seconds between refreshes of the liveness key (well inside the TTL: a busy CPU may delay one).
ALIVE_REFRESH_S: Final = 3.0
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


def known_queues(connection: Redis, prefix: str, names: Sequence[str]) -> list[str]:
    """`names`, then every other queue of this deployment RQ knows (a queue is known from its
    first job on: `gpu:a10g`, `gpu:tp2`), without the prefix."""
    from rq import Queue

    others = sorted(
        q.name[len(prefix) :]
        for q in Queue.all(connection=connection)
        if q.name.startswith(prefix) and q.name[len(prefix) :] not in names
    )
    return [*names, *others]


def live_workers(connection: Redis, prefix: str) -> dict[str, int]:
    """Live workers serving a queue of this deployment (its prefix), counted by GPU kind
    (`announced_workers`)."""
    return dict(Counter(w.kind.kind for w in announced_workers(connection, prefix)))


def announced_workers(connection: Redis, prefix: str) -> list[LiveWorker]:
    """Live workers serving a queue of this deployment (its prefix), each with what it
    announced (`route.WorkerKind`; `unknown`, one device, for an `rq worker` started by hand)
    and the queues it serves (without the prefix): a `replay-audit worker` while its liveness
    key lives (`worker_alive`: RQ's own record of a killed worker outlives it by the job
    timeout)."""
    from rq import Worker

    workers = [
        w
        for w in Worker.all(connection=connection)
        if any(q.startswith(prefix) for q in w.queue_names())
        and worker_alive(connection, prefix, w.name)
    ]
    kinds = connection.hmget(prefix + WORKER_KINDS, [w.name for w in workers]) if workers else []
    return [
        LiveWorker(
            WorkerKind.from_json(k.decode()) if isinstance(k, bytes) else WorkerKind(UNKNOWN_KIND),
            frozenset(q[len(prefix) :] for q in w.queue_names() if q.startswith(prefix)),
        )
        for w, k in zip(workers, kinds, strict=True)
    ]


def announce_worker(connection: Redis, prefix: str, worker_name: str, kind: WorkerKind) -> None:
    """Say what worker `worker_name` runs on: its GPU kind, name, compute capability and
    device count (`forget_worker` at its exit)."""
    connection.hset(prefix + WORKER_KINDS, worker_name, kind.to_json())


def forget_worker(connection: Redis, prefix: str, worker_name: str) -> None:
    connection.hdel(prefix + WORKER_KINDS, worker_name)


def register_again(worker: Worker) -> None:
    """Put a started RQ `worker` back in RQ's worker registry when Redis lost it (a restart
    without persistence, a flush): RQ registers a worker once, at its birth, and its
    heartbeat does not bring it back. A worker not born yet, or dead, is left alone."""
    from rq import worker_registration

    if worker.birth_date is None or worker.connection.hexists(worker.key, "death"):
        return
    with worker.connection.pipeline() as pipeline:
        pipeline.hset(worker.key, mapping=worker.serialize())
        worker_registration.register(worker, pipeline)
        pipeline.expire(worker.key, worker.worker_ttl + 60)
        pipeline.execute()


def keep_alive(
    connection: Redis,
    prefix: str,
    worker_name: str,
    stop: threading.Event,
    announce: Callable[[], None] = lambda: None,
) -> threading.Thread:
    """Start a daemon thread that refreshes worker `worker_name`'s liveness key until `stop` is
    set (then it deletes it) or the process dies (then it expires within `ALIVE_TTL_S`). When
    the key is found gone, Redis lost the worker's records (restarted, flushed): the thread
    calls `announce` to write them again."""
    key = prefix + WORKER_ALIVE + worker_name

    def loop() -> None:
        from redis.exceptions import RedisError

        while True:
            # Redis down: the worker's own loop says so; the next refresh tries again.
            with contextlib.suppress(RedisError):
                if not connection.set(key, "1", ex=ALIVE_TTL_S, xx=True):
                    announce()
                    connection.set(key, "1", ex=ALIVE_TTL_S)
            if stop.wait(ALIVE_REFRESH_S):
                break
        with contextlib.suppress(RedisError):
            connection.delete(key)

    connection.set(key, "1", ex=ALIVE_TTL_S)  # before the first job is taken
    thread = threading.Thread(target=loop, name="replay-audit-worker-alive", daemon=True)
    thread.start()
    return thread


def worker_alive(connection: Redis, prefix: str, worker_name: str) -> bool:
    """Whether worker `worker_name` is alive: its liveness key for a `replay-audit worker` (one
    that recorded its GPU kind), RQ's worker registry for any other (`rq worker` by hand)."""
    if connection.exists(prefix + WORKER_ALIVE + worker_name):
        return True
    if connection.hexists(prefix + WORKER_KINDS, worker_name):
        return False  # ours, and its key expired: it died
    from rq import Worker

    return bool(connection.exists(Worker.redis_worker_namespace_prefix + worker_name))
