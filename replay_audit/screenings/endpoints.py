"""HTTP: `/v1/screenings`. Thin: parse, call one service function, return a schema."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from replay_audit.api.deps import AppSettings, Checkpoints, DBSession, Queue, Reader, Writer
from replay_audit.config import work_budget
from replay_audit.screenings import service
from replay_audit.screenings.schemas import ScreeningCreate, ScreeningCreated, ScreeningRead

router = APIRouter(prefix="/v1/screenings", tags=["screenings"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=ScreeningCreated,
    responses={200: {"description": "An existing screening with the same idempotency_key"}},
)
def create_screening(
    body: ScreeningCreate,
    session: DBSession,
    queue: Queue,
    principal: Writer,
    response: Response,
    checkpoints: Checkpoints,
    settings: AppSettings,
) -> ScreeningCreated:
    """Screen a checkpoint on a worker's platform before deploying it (queued; poll it). The
    checkpoint must be in the API's `REPLAY_AUDIT_MODEL_DIRS` too: its config.json and tokenizer
    bound the work (422 naming the prompt past the context or the vocabulary, or `prompts` past
    `REPLAY_AUDIT_SCREENING_TOKEN_BUDGET`, `_CPU_TOKEN_BUDGET` where it runs on a CPU)."""
    budget = work_budget(settings, "screening", queue.runs_on_cpu(body.device))
    screening, created = service.create_screening(
        session, principal.project_id, body, queue, checkpoints, budget
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    return ScreeningCreated(id=screening.public_id, created=created)


@router.get("/{screening_id}", response_model=ScreeningRead)
def read_screening(screening_id: str, session: DBSession, principal: Reader) -> ScreeningRead:
    """Status and, when done, the report (docs/screening.md)."""
    screening = service.get_screening(session, principal.project_id, screening_id)
    return service.to_read(screening, principal.project)
