"""The FastAPI application factory.

    from replay_audit.api.app import create_app
    app = create_app(settings)          # routers, error handlers, database from the settings

Each domain contributes an `APIRouter` from its `endpoints.py`; add it to `_routers()`.
OpenAPI is at `/openapi.json`, the interactive docs at `/docs`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI
from pydantic import BaseModel

import replay_audit
from replay_audit.api.body_limit import BodyLimitMiddleware
from replay_audit.api.errors import install_error_handlers
from replay_audit.api.health import router as health_router
from replay_audit.config import Settings, get_settings
from replay_audit.db.engine import get_engine, get_sessionmaker
from replay_audit.imports.schemas import ImportRequest
from replay_audit.queue import build_job_queue
from replay_audit.traces.schemas import TraceBatchCreate, TraceCreate


def _routers() -> list[APIRouter]:
    from replay_audit.audits.endpoints import router as audits_router
    from replay_audit.auth.endpoints import router as keys_router
    from replay_audit.imports.endpoints import router as imports_router
    from replay_audit.replays.endpoints import router as replays_router
    from replay_audit.reports.endpoints import router as reports_router
    from replay_audit.traces.endpoints import router as traces_router

    return [
        health_router,
        traces_router,
        imports_router,
        replays_router,
        reports_router,
        keys_router,
        audits_router,
    ]


#: Request bodies read raw by their endpoints (for speed and the size limit), so FastAPI does
#: not see them; their schemas are added to the OpenAPI components by hand.
_RAW_BODY_MODELS: tuple[type[BaseModel], ...] = (TraceCreate, TraceBatchCreate, ImportRequest)


def _install_openapi(app: FastAPI) -> None:
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base_openapi()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _RAW_BODY_MODELS:
            model_schema = model.model_json_schema(
                ref_template="#/components/schemas/{model}", mode="validation"
            )
            for name, definition in model_schema.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components[model.__name__] = model_schema
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings | None = None) -> FastAPI:
    """A configured app: database from `settings.database_url` (engines are shared per URL),
    the `/v1` routers, `/healthz`, one error handler for the domain errors."""
    settings = settings or get_settings()
    app = FastAPI(
        title="replay-audit",
        version=replay_audit.__version__,
        summary="Cross-precision replay and audit of LLM inference",
        docs_url="/docs",
    )
    app.state.settings = settings
    app.state.engine = get_engine(settings.database_url)
    app.state.sessionmaker = get_sessionmaker(settings.database_url)
    #: The job queue (in-process thread or RQ, and what it can run): built once, here.
    app.state.queue = build_job_queue(settings)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    for router in _routers():
        app.include_router(router)
    from replay_audit.ui import mount_ui

    mount_ui(app)  # the auditors' HTML pages under /ui (their own error pages)
    _install_openapi(app)
    return app
