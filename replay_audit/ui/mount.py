"""The UI's ASGI app and its mounting at `/ui` (see the package docstring)."""

from __future__ import annotations

import logging
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from replay_audit.api.deps import refuse_unstorable_parameters
from replay_audit.api.errors import database_unavailable, error_from_validation
from replay_audit.exceptions import ReplayAuditError
from replay_audit.telemetry.log import current
from replay_audit.ui.audit_pages import router as audit_router
from replay_audit.ui.pages import SignInRequired, router
from replay_audit.ui.screening_pages import router as screening_router
from replay_audit.ui.templating import STATIC_DIR, render
from replay_audit.ui.trace_pages import router as trace_router
from replay_audit.ui.verification_pages import router as verification_router

logger = logging.getLogger(__name__)

UI_PREFIX = "/ui"


def _error_page(request: Request, status: int, title: str, message: str) -> Response:
    return render(
        request,
        "ui/error.html",
        {
            "status": status,
            "title": title,
            "message": message,
            "principal": None,
            "csrf_token": "",
            # A 5xx page names the request (the X-Request-ID header): its log lines carry it.
            "request_id": current("request_id") if status >= 500 else None,
        },
        status,
    )


async def _sign_in_required(request: Request, exc: Exception) -> Response:
    base = request.scope.get("root_path", "")
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"{base}/sign-in?{urlencode({'next': target})}", status_code=303)


async def _domain_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ReplayAuditError)
    titles = {400: "Bad request", 403: "Not allowed", 404: "Not found", 422: "Invalid input"}
    if exc.status_code >= 500:
        logger.error("%s: %s", type(exc).__name__, exc.message)
    return _error_page(request, exc.status_code, titles.get(exc.status_code, "Error"), exc.message)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    error = error_from_validation(list(exc.errors()))
    return _error_page(request, 422, "Invalid input", error.message)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    title = "Not found" if exc.status_code == 404 else "Error"
    return _error_page(request, exc.status_code, title, str(exc.detail))


async def _database_error(request: Request, exc: Exception) -> Response:
    error = database_unavailable(exc)
    logger.error("%s on %s %s", error.message, request.method, request.url.path)
    return _error_page(request, 503, "Database unavailable", error.message)


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error_page(request, 500, "Internal error", "Something went wrong on our side.")


def create_ui_app(parent: FastAPI) -> FastAPI:
    """The UI app, sharing `parent`'s settings and database."""
    ui = FastAPI(
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        dependencies=[Depends(refuse_unstorable_parameters)],
    )
    # The queue: the run page says why jobs wait (`pending_reason`).
    for name in ("settings", "engine", "sessionmaker", "queue"):
        setattr(ui.state, name, getattr(parent.state, name))
    ui.add_exception_handler(SignInRequired, _sign_in_required)
    ui.add_exception_handler(ReplayAuditError, _domain_error)
    ui.add_exception_handler(RequestValidationError, _validation_error)
    ui.add_exception_handler(StarletteHTTPException, _http_error)
    ui.add_exception_handler(OperationalError, _database_error)
    ui.add_exception_handler(InterfaceError, _database_error)
    ui.add_exception_handler(Exception, _unexpected)
    for r in (router, audit_router, screening_router, verification_router, trace_router):
        ui.include_router(r)
    ui.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return ui


def mount_ui(app: FastAPI) -> None:
    """Mount the UI at `/ui` on the API app."""
    app.mount(UI_PREFIX, create_ui_app(app), name="ui")
