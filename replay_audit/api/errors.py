"""One place that turns errors into HTTP answers: `{"error", "detail", "field"}`.

- `ReplayAuditError` (the domain tree in `replay_audit.exceptions`): its own status and body.
- Request validation (pydantic, FastAPI): 422 `FieldError` naming the field path as
  `top_k.logits[3]`; a `TraceFieldError` raised inside a model validator names its own field;
  a trace over the size limit is 413; unparseable JSON is 400 naming `body`.
- Starlette and FastAPI HTTP errors: the domain error of their status, same body shape (404
  `NotFound`, 405 `MethodNotAllowed` with an `Allow` header listing every documented method
  of the path, 400 `BadRequest` naming `body` for a body FastAPI could not read or decode).
- Anything else: 500 `InternalError` with no detail; the traceback goes to the log only. It is
  answered by `InternalErrorMiddleware`, not by Starlette's outermost handler, which re-raises
  to the server after answering: uvicorn then closes the connection, and a keep-alive client
  loses the next request too.

Every 5xx body carries the request's `request_id` (the `X-Request-ID` answer header,
`api.observe`), so a report of one finds its log lines.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from replay_audit.exceptions import (
    BadRequest,
    DatabaseUnavailable,
    FieldError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ReplayAuditError,
)
from replay_audit.input import UnstorableText
from replay_audit.telemetry.log import current
from replay_audit.traces.schemas import TraceFieldError, TraceTooLarge

logger = logging.getLogger(__name__)


class ErrorBody(BaseModel):
    """The body of every error answer (the OpenAPI document declares it for each one)."""

    #: The error's class: `FieldError`, `NotFound`, ... (docs/api.md lists them).
    error: str
    #: What is wrong, for a person.
    detail: str
    #: The input at fault, when there is one: `config.dtype`, `top_k.logits[3]`, `body`.
    field: str | None = None
    #: The request's id (its `X-Request-ID` answer header), in 5xx bodies: the log lines of
    #: the failure carry it.
    request_id: str | None = None


#: Leading `loc` parts that say where a value came from, not which field it is.
_LOCATIONS = frozenset({"body", "query", "path", "header", "cookie"})


#: `loc` parts pydantic adds inside unions and dict keys, which name a schema, not a field.
_SCHEMA_TAG = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")


def format_loc(loc: Sequence[int | str]) -> str:
    """("top_k", "logits", 3) -> "top_k.logits[3]"; the request location prefix is dropped, and
    so are the union member tags pydantic adds ("str", "function-after[...]"); an invalid dict
    key names its dict."""
    parts = list(loc)
    if len(parts) > 1 and parts[0] in _LOCATIONS:
        parts = parts[1:]
    if len(parts) >= 2 and parts[-1] == "[key]":
        parts = parts[:-2]
    while len(parts) > 1 and isinstance(parts[-1], str) and _SCHEMA_TAG.match(parts[-1]):
        parts.pop()
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


def error_from_validation(errors: Sequence[Any]) -> ReplayAuditError:
    """The domain error for the first of pydantic's `errors()` (the one the client fixes first)."""
    if not errors:
        return FieldError("invalid input", field="body")
    # Unstorable text first: inside a union it comes with one error per member, the others
    # saying only that the value is not of that member's type.
    first = next(
        (e for e in errors if isinstance((e.get("ctx") or {}).get("error"), UnstorableText)),
        errors[0],
    )
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, TraceTooLarge):
        return PayloadTooLarge(str(cause), field=cause.field)
    if isinstance(cause, TraceFieldError):
        return FieldError(str(cause), field=cause.field)
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return BadRequest(f"malformed JSON: {reason}".rstrip(": "), field="body")
    field = format_loc(first.get("loc", ()))
    return FieldError(_message(first, field), field=field)


def _message(error: Any, field: str) -> str:
    """`field: message`, without pydantic's "Value error, " (a validator's own words follow it)
    and without a bare "body: " before an error of the whole body."""
    msg = str(error.get("msg", "invalid value"))
    cause = (error.get("ctx") or {}).get("error")
    if error.get("type") in ("value_error", "assertion_error") and cause is not None:
        msg = str(cause)
    return msg if field == "body" else f"{field}: {msg}"


def error_response(error: ReplayAuditError) -> JSONResponse:
    body = error.to_dict()
    if error.status_code >= 500:
        body["request_id"] = current("request_id")
    return JSONResponse(body, status_code=error.status_code)


async def _domain_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ReplayAuditError)
    if exc.status_code >= 500:
        logger.error("%s: %s", type(exc).__name__, exc.message)
    return error_response(exc)


async def _request_validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError | ValidationError)
    return error_response(error_from_validation(list(exc.errors())))


def _path_methods(request: Request) -> list[str]:
    """The methods the OpenAPI document lists for the request's path (HEAD with GET, as
    Starlette answers it)."""
    app = request.app
    routes: list[tuple[re.Pattern[str], frozenset[str]]] | None = getattr(
        app.state, "documented_methods", None
    )
    if routes is None:
        routes = [
            (
                re.compile("^" + re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(path)) + "$"),
                frozenset(m.upper() for m in item if m.upper() in _HTTP_METHODS),
            )
            for path, item in app.openapi().get("paths", {}).items()
        ]
        app.state.documented_methods = routes
    path = request.url.path
    methods = {m for pattern, allowed in routes if pattern.match(path) for m in allowed}
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


_HTTP_METHODS = frozenset({"GET", "PUT", "POST", "DELETE", "OPTIONS", "HEAD", "PATCH", "TRACE"})


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    error: ReplayAuditError
    if exc.status_code == 404:
        error = NotFound(str(exc.detail))
    elif exc.status_code == 405:
        error = MethodNotAllowed(f"{request.method} is not allowed on this path")
        headers["Allow"] = ", ".join(_path_methods(request))
    elif exc.status_code == 400:
        # FastAPI's answer to a body it could not read (invalid UTF-8, a failed read).
        error = BadRequest(f"unreadable request body: {exc.detail}", field="body")
    else:  # no route raises other statuses this way; keep their status, same body shape
        body = {"error": "HTTPError", "detail": str(exc.detail)}
        if exc.status_code >= 500:
            body["request_id"] = current("request_id") or ""
        return JSONResponse(body, status_code=exc.status_code, headers=headers)
    return JSONResponse(error.to_dict(), status_code=error.status_code, headers=headers)


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    """A database that cannot be reached (or answers that it cannot serve) is a 503."""
    logger.error("database unavailable on %s %s: %s", request.method, request.url.path, exc)
    return error_response(database_unavailable(exc))


def database_unavailable(exc: Exception) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"the database is unavailable ({type(exc).__name__}); try again shortly"
    )


def internal_error() -> dict[str, object]:
    """The body of every 500: nothing about the cause leaves the server, but the request id."""
    return {
        "error": "InternalError",
        "detail": "internal server error",
        "request_id": current("request_id"),
    }


class InternalErrorMiddleware:
    """Answers an unexpected exception with the 500 body, and keeps the connection. An
    exception after the response was sent in full (a mounted app's own error page) is logged
    and goes no further; one in the middle of a response is re-raised, as only closing the
    connection can tell the client that the body is cut short."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = complete = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, complete
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.error(
                "unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc
            )
            if started and not complete:
                raise
            if not started:
                await JSONResponse(internal_error(), status_code=500)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on `app`, and the middleware that answers the rest."""
    app.add_exception_handler(ReplayAuditError, _domain_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(ValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OperationalError, _database_error)
    app.add_exception_handler(InterfaceError, _database_error)
