"""`GET /healthz`: the process answers, and so do the database and the job queue (compose
health checks)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

from replay_audit.exceptions import QueueUnavailable
from replay_audit.queue import JobQueue

router = APIRouter(tags=["health"])


@router.get("/healthz", responses={503: {"description": "The database does not answer"}})
def healthz(request: Request) -> JSONResponse:
    """200 `{"status": "ok", "database": "ok", "queue": "ok"}` when a `SELECT 1` succeeds and
    the job queue takes work (Redis answers a ping under the RQ runner); 503 naming what failed
    otherwise. No key needed."""
    engine: Engine = request.app.state.engine
    queue: JobQueue = request.app.state.queue
    body = {"status": "ok", "database": "ok", "queue": "ok"}
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        body["database"] = type(exc).__name__
    try:
        queue.check()
    except QueueUnavailable as exc:
        body["queue"] = exc.message
    if body["database"] != "ok" or body["queue"] != "ok":
        body["status"] = "unavailable"
        return JSONResponse(body, status_code=503)
    return JSONResponse(body)
