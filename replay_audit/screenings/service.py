"""Screenings: create (validate, store, enqueue the job after commit), read, list. Services
take a session and never commit."""

from __future__ import annotations

from sqlalchemy.orm import Session

from replay_audit.db.base import read_model
from replay_audit.db.ids import new_public_id
from replay_audit.exceptions import Conflict, FieldError, NotFound
from replay_audit.queue import JobQueue, JobSpec
from replay_audit.replays.service import target_refusal
from replay_audit.screenings import repository
from replay_audit.screenings.models import Screening
from replay_audit.screenings.schemas import ScreeningCreate, ScreeningRead
from replay_audit.screenings.sweep.report import ScreeningReport

#: The job's dotted path: resolved on the worker, so the API process never imports torch.
JOB = "replay_audit.screenings.tasks.run_screening_job"


def job_spec(screening: Screening, timeout_s: int) -> JobSpec:
    """The one way a screening job is named and enqueued."""
    device = screening.request.get("device")
    return JobSpec(
        func=JOB,
        args=(screening.id,),
        job_id=f"screening-{screening.id}",
        queue="cpu" if device == "cpu" else "gpu",
        timeout_s=timeout_s,
    )


def create_screening(
    session: Session, project_id: int, request: ScreeningCreate, queue: JobQueue
) -> tuple[Screening, bool]:
    """Store a screening and enqueue its job after commit. Returns (screening, created): an
    `idempotency_key` already used in the project returns the existing one."""
    key = request.idempotency_key
    existing = key and repository.get_by_idempotency_key(session, project_id, key)
    if existing:
        return existing, False
    refusal = target_refusal(queue.capabilities, lm_head_dtype=None, device=request.device)
    if refusal is not None:
        raise FieldError(refusal, field="device")
    queue.check()
    screening = repository.add(
        session,
        Screening(
            public_id=new_public_id("sc"),
            project_id=project_id,
            status="queued",
            model_sha256=request.model_sha256,
            request=request.model_dump(mode="json"),
            idempotency_key=key,
        ),
    )
    if screening is None:  # a concurrent request with this idempotency_key stored it first
        existing = key and repository.get_by_idempotency_key(session, project_id, key)
        if not existing:
            raise Conflict(
                "a concurrent request is storing this screening; retry", field="idempotency_key"
            )
        return existing, False
    queue.enqueue(session, [job_spec(screening, queue.job_timeout_s)])
    return screening, True


def get_screening(session: Session, project_id: int, public_id: str) -> Screening:
    """The project's screening, or NotFound (another project's answers the same)."""
    s = repository.get_by_public_id(session, project_id, public_id)
    if s is None:
        raise NotFound(f"no screening {public_id}")
    return s


def report_of(screening: Screening) -> ScreeningReport | None:
    return (
        ScreeningReport.model_validate(screening.report) if screening.report is not None else None
    )


def to_read(screening: Screening, project: str) -> ScreeningRead:
    return read_model(
        ScreeningRead,
        screening,
        id=screening.public_id,
        project=project,
        report=report_of(screening),
    )


def recent_screenings(session: Session, project_id: int, limit: int = 20) -> list[Screening]:
    return repository.recent(session, project_id, limit)
