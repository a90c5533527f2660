"""The service's Prometheus metrics, defined once, and their exposition.

prometheus-client's model is one metric object per process, registered at import: in its
multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set before the process starts, as `serve
--workers N` does) each process writes its values to files of that directory, keyed by metric
and labels, and a scrape of any process adds up every process's files. Two objects of one metric
in one process would overwrite each other's values there, so these are module globals: the one
process-wide state the package keeps on purpose (tests/test_architecture.py says so).

Labels are bounded: route templates (never raw paths), job kinds, GPU kinds, queue names,
statuses and outcomes, schedule ids. No trace content, key material or project name is ever a
label or a value.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    start_http_server,
)
from prometheus_client.registry import Collector

from replay_audit.telemetry.multiprocess import multiprocess_dir

#: The exposition format's content type.
CONTENT_TYPE: Final = CONTENT_TYPE_LATEST

_PREFIX = "replay_audit_"

# --- API ----------------------------------------------------------------------------------------
HTTP_REQUESTS = Counter(
    _PREFIX + "http_requests_total",
    "HTTP requests answered, by method, route template and status.",
    ["method", "route", "status"],
)
HTTP_DURATION = Histogram(
    _PREFIX + "http_request_duration_seconds",
    "Seconds from the request's arrival to the end of its answer.",
    ["method", "route", "status"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
TRACES_INGESTED = Counter(
    _PREFIX + "traces_ingested_total",
    "Traces stored by POST /v1/traces and /v1/traces:batch: created, or existing (same content).",
    ["outcome"],
)
BATCH_ITEMS = Counter(
    _PREFIX + "trace_batch_items_total",
    "Items of POST /v1/traces:batch, by their own status (201, 200, 409, 413, 422).",
    ["status"],
)
AUTH_FAILURES = Counter(
    _PREFIX + "auth_failures_total",
    "Requests refused by the API key check: missing, invalid (unknown or revoked), forbidden.",
    ["reason"],
)

# --- jobs (workers, and the in-process runner of the embedded default) -------------------------
_JOB_LABELS = ["kind", "gpu_kind"]
JOBS_STARTED = Counter(_PREFIX + "jobs_started_total", "Jobs started.", _JOB_LABELS)
JOBS_FINISHED = Counter(_PREFIX + "jobs_finished_total", "Jobs that returned.", _JOB_LABELS)
JOBS_FAILED = Counter(_PREFIX + "jobs_failed_total", "Job attempts that raised.", _JOB_LABELS)
JOB_DURATION = Histogram(
    _PREFIX + "job_duration_seconds",
    "Seconds a job attempt ran, failed or not.",
    _JOB_LABELS,
    buckets=(0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0),
)
REPLAY_TRACES = Counter(
    _PREFIX + "replay_traces_total",
    "Trace x comparison items replayed, by stage: scanned (teacher-forced) or decoded.",
    ["stage", "gpu_kind"],
)
REPLAY_TOKENS = Counter(
    _PREFIX + "replay_tokens_total",
    "Output tokens run through the engine, by stage; tokens/s is its rate().",
    ["stage", "gpu_kind"],
)
MODEL_LOADS = Counter(_PREFIX + "model_loads_total", "Engines loaded (checkpoint x format).")
GPU_MEMORY = Gauge(
    _PREFIX + "gpu_memory_bytes",
    "CUDA memory of the worker's device after its last job: allocated or reserved by torch "
    "(a worker of several processes: their sum).",
    ["gpu_kind", "pool"],
    multiprocess_mode="livesum",
)

# --- audits --------------------------------------------------------------------------------------
DRIFT_ALERTS = Counter(
    _PREFIX + "drift_alerts_total", "Audit runs evaluated and flagged for drift."
)
WEBHOOK_DELIVERIES = Counter(
    _PREFIX + "webhook_deliveries_total",
    "Drift-alert webhook attempts: delivered, or the error class of the attempt.",
    ["outcome"],
)


def job_kind(func: str) -> str:
    """The kind label of a job function's dotted path: `...tasks.run_replay_job` -> `replay`,
    `...tasks.deliver_alert` -> `deliver_alert`."""
    name = func.rpartition(".")[2]
    return name.removeprefix("run_").removesuffix("_job")


@dataclass
class JobAttempt:
    """One job attempt being observed (`observe_job`)."""

    #: Set by a runner that learns of the failure otherwise than by an exception (RQ's
    #: `perform_job` returns False).
    failed: bool = False


@contextmanager
def observe_job(kind: str, gpu_kind: str) -> Iterator[JobAttempt]:
    """Count a job attempt started, then finished or failed (an exception, re-raised, or
    `failed` set), and time it."""
    labels = {"kind": kind, "gpu_kind": gpu_kind}
    JOBS_STARTED.labels(**labels).inc()
    started = time.perf_counter()
    attempt = JobAttempt()
    try:
        yield attempt
    except BaseException:
        JOBS_FAILED.labels(**labels).inc()
        raise
    else:
        (JOBS_FAILED if attempt.failed else JOBS_FINISHED).labels(**labels).inc()
    finally:
        JOB_DURATION.labels(**labels).observe(time.perf_counter() - started)


def scrape_registry(extra: Iterable[Collector] = ()) -> CollectorRegistry:
    """A registry of what a scrape of this process shows (every process's values in
    multiprocess mode), then the `extra` collectors, read at scrape time. A new registry per
    call: nothing process-wide is added to."""
    registry = CollectorRegistry(auto_describe=False)
    path = multiprocess_dir()
    if path is None:
        registry.register(REGISTRY)
    else:
        multiprocess.MultiProcessCollector(registry, path=str(path))  # type: ignore[no-untyped-call]
    for collector in extra:
        registry.register(collector)
    return registry


def exposition(extra: Iterable[Collector] = ()) -> bytes:
    """The text exposition of `scrape_registry(extra)`."""
    return generate_latest(scrape_registry(extra))


def start_metrics_server(
    host: str, port: int, extra: Iterable[Collector] = ()
) -> Callable[[], None]:
    """Serve `GET /metrics` (any path, as prometheus-client does) on `host:port` from a thread
    of this process; returns the function that stops it."""
    server, thread = start_http_server(port, addr=host, registry=scrape_registry(extra))

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop
