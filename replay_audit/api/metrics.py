"""`GET /metrics`: the Prometheus exposition of the API processes (docs/operations.md).

No API key needed: nothing in it names a project or carries trace content or key material
(`telemetry.metric` says which labels exist). Where it is served, if anywhere: the settings
`metrics_enabled` and `api_metrics_port` (`serve_metrics`); `metrics_token`, when set, is the
bearer token a scrape of the API's own `/metrics` must send.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import SecretStr
from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from replay_audit.audits.service import AUDIT_QUEUE, last_run_times
from replay_audit.config import Settings
from replay_audit.db.unit_of_work import session_scope
from replay_audit.queue.runner import REDIS_TIMEOUT_S, long_queue
from replay_audit.queue.state import announced_workers, known_queues, queue_states
from replay_audit.telemetry.metric import CONTENT_TYPE, exposition, start_metrics_server

log = logging.getLogger(__name__)

router = APIRouter()

#: The queues a deployment's jobs go to (with them, every per-kind queue RQ knows of:
#: `queue.state.known_queues`).
QUEUES = ("gpu", "cpu", long_queue("gpu"), long_queue("cpu"), AUDIT_QUEUE)
#: The queue label of the queues no live worker serves, summed (their oldest job: the max).
UNSERVED = "unserved"


@router.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
def metrics(request: Request) -> Response:
    """The Prometheus text exposition (no API key; the bearer token where one is set)."""
    token: SecretStr | None = request.app.state.settings.metrics_token
    if token is not None and not _bearer_is(request.headers.get("authorization"), token):
        return JSONResponse(
            {"detail": "/metrics needs the bearer token REPLAY_AUDIT_METRICS_TOKEN"},
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
        )
    collectors: list[Collector] = request.app.state.metric_collectors
    return Response(exposition(collectors), media_type=CONTENT_TYPE)


def _bearer_is(header: str | None, token: SecretStr) -> bool:
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), token.get_secret_value().encode()
    )


#: Seconds a read of the queues serves the scrapes of an API process (Prometheus scrapes every
#: 15 s or more): concurrent or back-to-back scrapers cost one Redis read, not one each.
QUEUE_READ_TTL_S = 2.0


class QueueCollector:
    """Each RQ queue's depth, running jobs and oldest waiting job's age, and the live workers
    per GPU kind, read from Redis at scrape time, at most once per `QUEUE_READ_TTL_S`
    (nothing under the in-process runner)."""

    def __init__(self, settings: Settings) -> None:
        self.enabled = settings.runner == "rq"
        self.redis_url = settings.redis_url
        self.prefix = settings.queue_prefix
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._families: list[GaugeMetricFamily] = []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if not self.enabled:
            return
        with self._lock:  # one read at a time; the scrapes waiting for it share it
            if time.monotonic() - self._read_at >= QUEUE_READ_TTL_S:
                self._families = list(self._read())
                self._read_at = time.monotonic()
            families = self._families
        yield from families

    def _read(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily(
            "replay_audit_queue_depth", "Jobs waiting in the queue.", labels=["queue"]
        )
        running = GaugeMetricFamily(
            "replay_audit_queue_running_jobs", "Jobs a worker is running.", labels=["queue"]
        )
        oldest = GaugeMetricFamily(
            "replay_audit_queue_oldest_job_age_seconds",
            "Seconds the oldest waiting job has waited (0: none waits).",
            labels=["queue"],
        )
        workers = GaugeMetricFamily(
            "replay_audit_workers_live", "Live RQ workers, by GPU kind.", labels=["gpu_kind"]
        )
        connection = Redis.from_url(
            self.redis_url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S
        )
        try:
            # A label per queue a live worker serves, and the fixed ones; every other queue
            # (a kind or degree no worker serves, which a request can name) folds into
            # `unserved`, so what requests name cannot grow the labels.
            live = announced_workers(connection, self.prefix)
            served = set(QUEUES).union(*(w.queues or () for w in live))
            names = known_queues(connection, self.prefix, QUEUES)
            rows: dict[str, list[float]] = {}
            for q in queue_states(connection, self.prefix, names):
                row = rows.setdefault(q.name if q.name in served else UNSERVED, [0, 0, 0.0])
                row[0] += q.depth
                row[1] += q.running
                row[2] = max(row[2], q.oldest_age_s or 0.0)
            for name, (n_waiting, n_running, age) in rows.items():
                depth.add_metric([name], n_waiting)
                running.add_metric([name], n_running)
                oldest.add_metric([name], age)
            for kind, n in sorted(Counter(w.kind.kind for w in live).items()):
                workers.add_metric([kind], n)
        except RedisError as e:  # the scrape goes on; /readyz says Redis is down
            log.warning("metrics: the queue state is unavailable: %s", e)
            return
        finally:
            connection.close()
        yield from (depth, running, oldest, workers)


class AuditCollector:
    """The due time of each active audit schedule's newest run, read at scrape time."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "replay_audit_audit_last_run_timestamp_seconds",
            "Unix time the newest run of each audit schedule was due (schedule: its id).",
            labels=["schedule"],
        )
        try:
            with session_scope(self.database_url) as session:
                times = last_run_times(session)
        except SQLAlchemyError as e:
            log.warning("metrics: the audit schedules are unavailable: %s", e)
            return
        for schedule, due in sorted(times.items()):
            due = due if due.tzinfo else due.replace(tzinfo=UTC)
            family.add_metric([schedule], due.timestamp())
        yield family


def collectors(settings: Settings) -> list[Collector]:
    """What a scrape of the API reads at that moment, besides the processes' counters."""
    return [QueueCollector(settings), AuditCollector(settings.database_url)]


def serve_metrics(settings: Settings) -> Callable[[], None] | None:
    """`serve`'s separate metrics listener (REPLAY_AUDIT_API_METRICS_PORT), started in its own
    process: with several API processes it reads all of their files. None when not asked for;
    else the function that stops it."""
    if not settings.metrics_enabled or settings.api_metrics_port is None:
        return None
    return start_metrics_server(
        settings.metrics_host, settings.api_metrics_port, collectors(settings)
    )
