"""One place that turns errors into HTTP answers: `{"error", "detail", "field"}`.

- `ReplayAuditError` (the domain tree in `replay_audit.exceptions`): its own status and body.
- Request validation (pydantic, FastAPI): 422 `FieldError` naming the field path as
  `top_k.logits[3]`; a `TraceFieldError` raised inside a model validator names its own field;
  a trace over the size limit is 413; unparseable JSON is 400 naming `body`.
- Starlette HTTP errors (unknown route, wrong method): their status, same body shape.
- Anything else: 500 `InternalError` with no detail; the traceback goes to the log only.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from replay_audit.exceptions import (
    BadRequest,
    FieldError,
    NotFound,
    PayloadTooLarge,
    ReplayAuditError,
)
from replay_audit.input import UnstorableText
from replay_audit.traces.schemas import TraceFieldError, TraceTooLarge

logger = logging.getLogger(__name__)

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
    return FieldError(f"{field}: {first.get('msg', 'invalid value')}", field=field)


def error_response(error: ReplayAuditError) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=error.status_code)


async def _domain_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ReplayAuditError)
    if exc.status_code >= 500:
        logger.error("%s: %s", type(exc).__name__, exc.message)
    return error_response(exc)


async def _request_validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError | ValidationError)
    return error_response(error_from_validation(list(exc.errors())))


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    error = NotFound(str(exc.detail)) if exc.status_code == 404 else None
    body = (
        error.to_dict() if error is not None else {"error": "HTTPError", "detail": str(exc.detail)}
    )
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(
        {"error": "InternalError", "detail": "internal server error"}, status_code=500
    )


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on `app`."""
    app.add_exception_handler(ReplayAuditError, _domain_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(ValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
