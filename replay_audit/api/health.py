"""`GET /healthz`: the process answers and the database does too (compose health checks)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

router = APIRouter(tags=["health"])


@router.get("/healthz", responses={503: {"description": "The database does not answer"}})
def healthz(request: Request) -> JSONResponse:
    """200 `{"status": "ok"}` when a `SELECT 1` succeeds, 503 otherwise. No key needed."""
    engine: Engine = request.app.state.engine
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        return JSONResponse(
            {"status": "unavailable", "database": type(exc).__name__}, status_code=503
        )
    return JSONResponse({"status": "ok", "database": "ok"})
