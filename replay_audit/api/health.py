"""`GET /healthz` (liveness, for compose health checks) and `GET /readyz` (readiness), no key
needed: the endpoints' docstrings (the OpenAPI document) say what each answers. Workers are
reported, and required only by `/readyz` with `REPLAY_AUDIT_READY_MIN_WORKERS` set."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

from replay_audit.config import Settings
from replay_audit.exceptions import QueueUnavailable
from replay_audit.queue import JobQueue
from replay_audit.queue.runner import RQRunner
from replay_audit.queue.state import live_workers
from replay_audit.telemetry.log import current

router = APIRouter(tags=["health"])


def _database(request: Request) -> str:
    engine: Engine = request.app.state.engine
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        return type(exc).__name__
    return "ok"


def _queue(request: Request) -> str:
    queue: JobQueue = request.app.state.queue
    try:
        queue.check()
    except QueueUnavailable as exc:
        return exc.message
    return "ok"


def _answer(body: dict[str, object], failed: bool) -> JSONResponse:
    if not failed:
        return JSONResponse(body)
    body["status"] = "unavailable"
    body["request_id"] = current("request_id")
    return JSONResponse(body, status_code=503)


def _worker_kinds(queue: JobQueue) -> list[dict[str, object]]:
    """The live workers' kinds, each with what its workers announced and how many there are
    (empty where the queue cannot say)."""
    counts = Counter(w.kind for w in queue.live_workers() or [])
    return [
        {"kind": k.kind, "gpu": k.gpu_name, "sm": k.sm, "devices": k.devices, "workers": n}
        for k, n in sorted(counts.items(), key=lambda kn: (kn[0].kind, kn[0].devices))
    ]


@router.get("/healthz", responses={503: {"description": "The database does not answer"}})
def healthz(request: Request) -> JSONResponse:
    """200 `{"status": "ok", "database": "ok", "queue": "ok", "worker_kinds": [...]}` when a
    `SELECT 1` succeeds and the job queue takes work (Redis answers a ping under the RQ
    runner); 503 naming what failed otherwise. `worker_kinds` lists the live workers' kinds:
    `{"kind": "a10g", "gpu": "NVIDIA A10G", "sm": "8.6", "devices": 1, "workers": 2}` (under
    the in-process runner, this process); it is reported, never a reason for a 503. No key
    needed."""
    queue: JobQueue = request.app.state.queue
    body: dict[str, object] = {"status": "ok", "database": _database(request)}
    body["queue"] = _queue(request)
    body["worker_kinds"] = _worker_kinds(queue) if body["queue"] == "ok" else []
    return _answer(body, body["database"] != "ok" or body["queue"] != "ok")


@router.get(
    "/readyz",
    responses={503: {"description": "A required component (database, queue, workers) is down"}},
)
def readyz(request: Request) -> JSONResponse:
    """200 `{"status": "ok", "database": "ok", "queue": "ok", "workers": {"<gpu kind>": n}}`
    when the service can take and run work; 503 naming what is down otherwise. `workers`
    counts the live workers per GPU kind (`cpu`, or the GPU's name); under the in-process
    runner, this process (`cpu` or `cuda`). No key needed."""
    settings: Settings = request.app.state.settings
    queue: JobQueue = request.app.state.queue
    body: dict[str, object] = {"status": "ok", "database": _database(request)}
    body["queue"] = _queue(request)
    workers: dict[str, int] = {}
    if isinstance(queue.runner, RQRunner):
        if body["queue"] == "ok":
            try:
                workers = live_workers(queue.runner.connection, queue.runner.prefix)
            except RedisError as exc:
                body["queue"] = f"the job queue (Redis) is unreachable: {exc}"
    else:
        workers = {"cuda" if queue.capabilities.cuda else "cpu": 1}
    body["workers"] = workers
    short = sum(workers.values()) < settings.ready_min_workers
    return _answer(body, body["database"] != "ok" or body["queue"] != "ok" or short)


# HEAD answers as GET (load balancers and uptime checks probe with it), outside the schema.
router.add_api_route("/healthz", healthz, methods=["HEAD"], include_in_schema=False)
router.add_api_route("/readyz", readyz, methods=["HEAD"], include_in_schema=False)
