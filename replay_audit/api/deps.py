"""Request dependencies: the unit of work, the caller, the settings, the raw body.

The unit of work is opened per request and committed once, after the endpoint returned and
before the response is sent (`scope="function"`): a client that got a 2xx knows the data is
durable, and a failed commit is an error answer, not a lie. Any exception rolls it back.

    @router.get("/v1/things/{id}")
    def read_thing(
        id: str,
        session: DBSession,
        principal: Principal = Depends(require_role(Role.auditor, Role.admin)),
    ) -> ThingRead:
        return things_service.get(session, principal.project_id, id)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Annotated, Any

import anyio
from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from replay_audit.auth import service as auth_service
from replay_audit.auth.models import READER_ROLES, Role
from replay_audit.auth.schemas import Principal
from replay_audit.auth.service import PrincipalCache
from replay_audit.config import Settings
from replay_audit.db.unit_of_work import UnitOfWork, end_unit, open_unit
from replay_audit.exceptions import (
    FieldError,
    NotAuthenticated,
    PayloadTooLarge,
    PermissionDenied,
    QueueUnavailable,
)
from replay_audit.input import find_unstorable
from replay_audit.queue import JobQueue
from replay_audit.telemetry.log import note
from replay_audit.telemetry.metric import AUTH_FAILURES
from replay_audit.worker.checkpoint import CheckpointIndex

_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


async def refuse_unstorable_parameters(request: Request) -> None:
    """422 naming the parameter when a path or query parameter holds a character no database
    can store in text (NUL, a lone surrogate: `replay_audit.input`). Installed once on the app
    (and the UI app), so it runs before every route's own dependencies: no such value reaches
    a query. Request bodies get the same check from `InputModel`."""
    parameters = [*request.path_params.items(), *request.query_params.multi_items()]
    for name, value in parameters:
        bad = find_unstorable(value) if isinstance(value, str) else None
        if bad is not None:
            raise FieldError(
                f"{name}: must not contain U+{ord(bad):04X} (a database cannot store it in text)",
                field=name,
            )


def _app_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A dependency that returns the app's `name`, built once by `create_app` (`app.state`)."""

    async def dependency(request: Request) -> Any:
        return getattr(request.app.state, name)

    return dependency


async def get_uow(request: Request) -> AsyncIterator[UnitOfWork]:
    """The request's unit of work (see the module docstring). When the job queue failed to take
    work after the commit, the answer is that 503: what was stored stays, and the reconciler
    enqueues it once the queue is back.

    What touches the database runs in the threadpool, as sync endpoints do; the rest here, on
    the event loop: a writer's session connects at its first statement, in the endpoint, so a
    POST costs the one hop of its endpoint and one for the commit."""
    factory = request.app.state.sessionmaker
    if request.method in _READ_METHODS:
        uow = await run_in_threadpool(partial(open_unit, factory, read_only=True))
    else:
        uow = open_unit(factory)
    try:
        yield uow
    except BaseException as e:
        with anyio.CancelScope(shield=True):  # a cancelled request still gives back its session
            await run_in_threadpool(end_unit, uow, e)
        raise
    with anyio.CancelScope(shield=True):
        await run_in_threadpool(end_unit, uow, None)
    for error in uow.callback_errors:
        if isinstance(error, QueueUnavailable):
            raise QueueUnavailable(
                f"{error.message}; what this request stored is kept, and its jobs stay queued "
                "in the database until the queue is back (`replay-audit reconcile`, or the "
                "scheduler, enqueues them)"
            )


UoW = Annotated[UnitOfWork, Depends(get_uow, scope="function")]


async def get_session(uow: UoW) -> Session:
    """The request's session (services take this; they never commit it)."""
    return uow.session


DBSession = Annotated[Session, Depends(get_session)]
#: The settings the app was created with.
AppSettings = Annotated[Settings, Depends(_app_state("settings"))]
#: The app's job queue, built from its settings.
get_queue = _app_state("queue")
Queue = Annotated[JobQueue, Depends(get_queue)]
#: The app's index of the checkpoints in its `REPLAY_AUDIT_MODEL_DIRS`.
Checkpoints = Annotated[CheckpointIndex, Depends(_app_state("checkpoints"))]
#: The app's cache of recently authenticated keys (`auth.service.PrincipalCache`).
Principals = Annotated[PrincipalCache, Depends(_app_state("principals"))]


async def get_principal(
    request: Request,
    session: DBSession,
    x_api_key: Annotated[str | None, Header(alias="X-API-Key")] = None,
) -> Principal:
    """The caller, from the `X-API-Key` header (401 if missing, unknown or revoked; a key
    that passed within `Settings.api_key_cache_s` needs no query, nor a thread). Its project
    goes on the request's log lines; a refusal is counted (`replay_audit_auth_failures_total`).
    """
    cache: PrincipalCache = request.app.state.principals
    principal = auth_service.cached_principal(cache, x_api_key)
    if principal is None:
        try:
            principal = await run_in_threadpool(
                auth_service.authenticate, session, x_api_key, cache
            )
        except NotAuthenticated:
            AUTH_FAILURES.labels("missing" if not x_api_key else "invalid").inc()
            raise
    note(project=principal.project)
    return principal


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


def require_role(*roles: Role) -> Callable[[Principal], Awaitable[Principal]]:
    """A dependency that returns the caller if their role is one of `roles`, else 403.

    A key only ever sees its own project: endpoints filter by `principal.project_id` and answer
    404 (not 403) for another project's objects, so ids of other projects leak nothing.
    """
    allowed = frozenset(roles)

    async def dependency(principal: CurrentPrincipal) -> Principal:
        if principal.role not in allowed:
            AUTH_FAILURES.labels("forbidden").inc()
            raise PermissionDenied(
                f"role {principal.role.value!r} may not do this; needs one of "
                + ", ".join(sorted(r.value for r in allowed))
            )
        return principal

    return dependency


#: The roles of the domains' endpoints: who may create (a submitter, an admin), who may read.
Writer = Annotated[Principal, Depends(require_role(Role.submitter, Role.admin))]
Reader = Annotated[Principal, Depends(require_role(*READER_ROLES))]


async def read_body(request: Request) -> bytes:
    """The raw request body, refused with 413 past `max_request_bytes`: first by the declared
    Content-Length, then while streaming (a client may lie or send chunked)."""
    limit: int = request.app.state.settings.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body over {limit} bytes", field="body")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes", field="body")
        chunks.append(chunk)
    return b"".join(chunks)


RawBody = Annotated[bytes, Depends(read_body)]
