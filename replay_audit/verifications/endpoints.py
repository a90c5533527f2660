"""HTTP: `/v1/verifications`. Thin: parse, call one service function, return a schema."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from replay_audit.api.deps import DBSession, Queue, Reader, Writer
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
) -> VerificationCreated:
    """Verify stored traces against the checkpoint they claim (queued; poll it)."""
    v, created = service.create_verification(session, principal.project_id, body, queue)
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
