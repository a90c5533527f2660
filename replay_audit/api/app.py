"""The FastAPI application factory, `create_app`. Each domain contributes an `APIRouter` from
its `endpoints.py`: add it to `_routers()`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import RedirectResponse
from pydantic import BaseModel

import replay_audit
from replay_audit.api.body_limit import BodyLimitMiddleware
from replay_audit.api.deps import refuse_unstorable_parameters
from replay_audit.api.docs import install_docs
from replay_audit.api.errors import ErrorBody, InternalErrorMiddleware, install_error_handlers
from replay_audit.api.health import router as health_router
from replay_audit.api.metrics import collectors
from replay_audit.api.metrics import router as metrics_router
from replay_audit.api.observe import ObserveMiddleware
from replay_audit.auth.service import PrincipalCache
from replay_audit.config import Settings, get_settings
from replay_audit.db.engine import get_engine, get_sessionmaker
from replay_audit.imports.schemas import ImportRequest
from replay_audit.json_value import JsonObject, JsonValue, as_object
from replay_audit.queue import Runner, build_job_queue, build_runner, stop_runner
from replay_audit.traces.schemas import TraceBatchCreate, TraceCreate
from replay_audit.worker.checkpoint import CheckpointIndex


def _routers() -> list[APIRouter]:
    from replay_audit.audits.endpoints import router as audits_router
    from replay_audit.auth.endpoints import router as keys_router
    from replay_audit.imports.endpoints import router as imports_router
    from replay_audit.replays.endpoints import router as replays_router
    from replay_audit.reports.endpoints import router as reports_router
    from replay_audit.screenings.endpoints import router as screenings_router
    from replay_audit.traces.endpoints import router as traces_router
    from replay_audit.verifications.endpoints import router as verifications_router

    return [
        health_router,
        traces_router,
        imports_router,
        replays_router,
        reports_router,
        screenings_router,
        verifications_router,
        keys_router,
        audits_router,
    ]


def raw_body_models() -> tuple[type[BaseModel], ...]:
    """Request bodies read raw by their endpoints (for speed and the size limit), so FastAPI
    does not see them; their schemas are added to the OpenAPI components by hand."""
    return (TraceCreate, TraceBatchCreate, ImportRequest)


#: Error answers every operation under /v1 may give (the key, the database, a bug), and those
#: of operations with parameters or a body. Statuses an endpoint declares itself (409) keep
#: their description and get the error body too.
_API_ERRORS: dict[str, str] = {
    "401": "Missing, unknown or revoked API key",
    "403": "The key's role may not do this",
    "404": "No such object in the key's project (or no such route)",
    "500": "A bug; the body says nothing more (the traceback is logged server-side)",
    "503": "The database (or the job queue) is unavailable; retry later",
}
_INPUT_ERRORS: dict[str, str] = {
    "422": "Invalid input; `field` names it, e.g. `config.dtype` or `top_k.logits[3]`",
}
_BODY_ERRORS: dict[str, str] = {
    "400": "Malformed JSON, an empty or unreadable body (`field`: `body`)",
    "413": "Body over `max_request_bytes` (or a trace or batch over its size limit)",
}


def _document_errors(schema: JsonObject) -> None:
    """Every error answer of every operation, with the one error body (`ErrorBody`) in place
    of FastAPI's `HTTPValidationError`, which this API never sends."""
    components = as_object(as_object(schema["components"])["schemas"])
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["ErrorBody"] = ErrorBody.model_json_schema()
    body: JsonObject = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path, item in as_object(schema["paths"]).items():
        for operation in map(as_object, as_object(item).values()):
            responses = as_object(operation.setdefault("responses", {}))
            errors = {"500": _API_ERRORS["500"]}
            if path.startswith("/v1/"):
                errors |= _API_ERRORS
                if operation.get("parameters") or "requestBody" in operation:
                    errors |= _INPUT_ERRORS
                if "requestBody" in operation:
                    errors |= _BODY_ERRORS
            for status in [*errors, *responses]:
                if int(status) >= 400 and (path.startswith("/v1/") or status in errors):
                    described = as_object(responses.get(status, {})).get("description")
                    if described in (None, "Validation Error"):
                        described = errors.get(status, "Error")
                    responses[status] = {"description": described, "content": body}


#: What `InputModel` and `refuse_unstorable_parameters` enforce on every string, for the
#: strings of the document that do not already say more (a pattern, a format, an enum).
_STORABLE_TEXT = "^[^\\x00]*$"


def _document_storable_text(node: JsonValue) -> None:
    if isinstance(node, list):
        for item in node:
            _document_storable_text(item)
    elif isinstance(node, dict):
        if node.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(node):
            node["pattern"] = _STORABLE_TEXT
        for value in node.values():
            _document_storable_text(value)


def _install_openapi(app: FastAPI) -> None:
    base_openapi = app.openapi

    def openapi() -> JsonObject:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema: JsonObject = base_openapi()
        components = as_object(
            as_object(schema.setdefault("components", {})).setdefault("schemas", {})
        )
        for model in raw_body_models():
            model_schema = model.model_json_schema(
                ref_template="#/components/schemas/{model}", mode="validation"
            )
            for name, definition in as_object(model_schema.pop("$defs", {})).items():
                components.setdefault(name, definition)
            components[model.__name__] = model_schema
        _document_errors(schema)
        _document_storable_text(schema["paths"])
        for name, component in components.items():
            if name != "ErrorBody":  # it may quote what was refused
                _document_storable_text(component)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


#: Seconds the app's own in-process runner gets to finish the trace it is on at shutdown.
RUNNER_STOP_TIMEOUT_S: Final = 30.0


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    # The runner the app built is the app's: its thread stops with the app (uvicorn's shutdown,
    # a TestClient's exit). A runner it was given is its giver's to stop.
    own: Runner | None = app.state.own_runner
    if own is not None:
        stop_runner(own, RUNNER_STOP_TIMEOUT_S)


def _root() -> RedirectResponse:
    """`GET /`, where uvicorn's banner points a newcomer: the UI (the API's docs are linked from
    there and served at /docs), not a JSON 404."""
    return RedirectResponse("/ui/", status_code=307)


def create_app(settings: Settings | None = None, *, runner: Runner | None = None) -> FastAPI:
    """A configured app (database engines are shared per URL). Jobs go to `runner` (the
    caller's: `serve` shares one with its scheduler, and stops it), or to one the app builds
    from the settings and owns: its in-process thread, if any, stops with the app."""
    settings = settings or get_settings()
    own_runner = None if runner is not None else build_runner(settings)
    app = FastAPI(
        lifespan=_lifespan,
        title="replay-audit",
        version=replay_audit.__version__,
        summary="Cross-precision replay and audit of LLM inference",
        # Our own /docs and /redoc (`api.docs`): assets served locally, no CDN.
        docs_url=None,
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
        dependencies=[Depends(refuse_unstorable_parameters)],
    )
    app.state.settings = settings
    app.state.engine = get_engine(settings.database_url)
    app.state.sessionmaker = get_sessionmaker(settings.database_url)
    app.state.queue = build_job_queue(settings, runner or own_runner)
    app.state.checkpoints = CheckpointIndex(settings.model_dirs)
    app.state.principals = PrincipalCache(settings.api_key_cache_s)
    app.state.own_runner = own_runner
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(InternalErrorMiddleware)
    # Added last, the outermost: its request id is bound before anything can fail, and it
    # sees every answer (a 500 of InternalErrorMiddleware included).
    metrics_here = settings.metrics_enabled and settings.api_metrics_port is None
    app.add_middleware(ObserveMiddleware, metrics=settings.metrics_enabled)
    app.state.metric_collectors = collectors(settings)
    for router in _routers():
        app.include_router(router)
    if metrics_here:
        app.include_router(metrics_router)
    from replay_audit.ui import mount_ui

    mount_ui(app)  # the auditors' HTML pages under /ui (their own error pages)
    app.add_api_route("/", _root, methods=["GET"], include_in_schema=False)
    install_docs(app)
    _install_openapi(app)
    return app
