"""Jobs that inject a fault into the `replay-audit worker` process running them (its
SimpleWorker runs jobs in its own process): imported by the worker, so nothing heavy here."""

from __future__ import annotations

from typing import Any


def time_out_redis_after_this_job() -> None:
    """Make the worker's next write of its own state to Redis, right after this job, raise
    redis' TimeoutError, once (as a Redis that does not answer in time would): RQ's work loop
    gives up on it. Every later call reaches Redis as before."""
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from rq.worker import BaseWorker

    real = BaseWorker.set_state

    def once(self: Any, state: str, pipeline: Any = None) -> None:
        BaseWorker.set_state = real  # type: ignore[method-assign]
        raise RedisTimeoutError("Timeout reading from socket (injected by the test)")

    BaseWorker.set_state = once  # type: ignore[method-assign]
