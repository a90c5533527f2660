"""HTTP: `/v1/replays`. Thin: parse, call one service function, return a schema."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response, status

from replay_audit.api.deps import AppSettings, DBSession, Queue, Reader, Writer, require_role
from replay_audit.auth.models import READER_ROLES, Role
from replay_audit.auth.schemas import Principal
from replay_audit.db.ids import cursor_pattern
from replay_audit.replays import service
from replay_audit.replays.schemas import Page, ReplayCreate, ReplayCreated, ReplayRead

router = APIRouter(prefix="/v1/replays", tags=["replays"])

#: Polling a run's status: whoever may create one, and the result readers. A submitter gets the
#: status view only (`service.to_read(..., status_only=True)`).
StatusReader = Annotated[Principal, Depends(require_role(Role.submitter, *READER_ROLES))]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=ReplayCreated,
    responses={200: {"description": "An existing run with the same idempotency_key"}},
)
def create_replay(
    body: ReplayCreate,
    session: DBSession,
    queue: Queue,
    principal: Writer,
    response: Response,
    settings: AppSettings,
) -> ReplayCreated:
    """Replay stored traces in one or more target configurations (queued; poll the run). With
    no `mode`, a large run (`REPLAY_AUDIT_LARGE_RUN_TRACES` traces or more) is replayed
    scan-then-decode, a smaller one decoded."""
    run, created = service.create_replay(
        session,
        principal.project_id,
        body,
        queue,
        defaults=service.RunDefaults.from_settings(settings),
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    return ReplayCreated(id=run.public_id, created=created)


@router.get("/{run_id}", response_model=ReplayRead)
def read_replay(
    run_id: str, session: DBSession, principal: StatusReader, queue: Queue
) -> ReplayRead:
    """Status, progress and, when done, the statistics; `pending_reason` while jobs wait for a
    GPU kind or TP degree no live worker serves. A submitter key gets status and progress
    only: `statistics` and `aggregate` null, `request` without `trace_ids`."""
    run = service.get_replay(session, principal.project_id, run_id)
    return service.to_read(
        session,
        run,
        principal.project,
        status_only=principal.role not in READER_ROLES,
        queue=queue,
    )


@router.get("/{run_id}/results", response_model=Page)
def read_results(
    run_id: str,
    session: DBSession,
    principal: Reader,
    cursor: Annotated[
        str | None,
        Query(pattern=cursor_pattern("r"), description="`next_cursor` of the previous page"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> Page:
    """Per-trace results, one item per trace x comparison, cursor-paginated."""
    run = service.get_replay(session, principal.project_id, run_id)
    return service.results_page(session, run, cursor=cursor, limit=limit)
