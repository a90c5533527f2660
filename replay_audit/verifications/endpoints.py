"""HTTP: `/v1/verifications`. Thin: parse, call one service function, return a schema."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from replay_audit.api.deps import AppSettings, DBSession, Queue, Reader, Writer
from replay_audit.config import work_budget
from replay_audit.verifications import service
from replay_audit.verifications.schemas import (
    VerificationCreate,
    VerificationCreated,
    VerificationRead,
)

router = APIRouter(prefix="/v1/verifications", tags=["verifications"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=VerificationCreated,
    responses={200: {"description": "An existing verification with the same idempotency_key"}},
)
def create_verification(
    body: VerificationCreate,
    session: DBSession,
    queue: Queue,
    principal: Writer,
    response: Response,
    settings: AppSettings,
) -> VerificationCreated:
    """Verify stored traces against the checkpoint they claim (queued; poll it). A selection
    of more tokens than `REPLAY_AUDIT_VERIFICATION_TOKEN_BUDGET` (`_CPU_TOKEN_BUDGET` where it
    runs on a CPU) is a 422 naming `filter`."""
    budget = work_budget(settings, "verification", queue.runs_on_cpu(body.device))
    v, created = service.create_verification(
        session, principal.project_id, body, queue, budget=budget
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    return VerificationCreated(id=v.public_id, created=created, traces=service.traces_of(v))


@router.get("/{verification_id}", response_model=VerificationRead)
def read_verification(
    verification_id: str, session: DBSession, principal: Reader
) -> VerificationRead:
    """Status and, when done, the report (docs/verify.md)."""
    v = service.get_verification(session, principal.project_id, verification_id)
    return service.to_read(v, principal.project)
