"""Screenings: create (validate, store, enqueue the job after commit), read, list. Services
take a session and never commit."""

from __future__ import annotations

from functools import partial
from typing import Final

from sqlalchemy.orm import Session

from replay_audit.config import WorkBudget
from replay_audit.db.base import read_model
from replay_audit.db.ids import new_public_id
from replay_audit.db.jobs import insert_once
from replay_audit.exceptions import FieldError
from replay_audit.queue import JobQueue, long_job_spec
from replay_audit.replays.service import target_refusal
from replay_audit.screenings import repository
from replay_audit.screenings.models import Screening
from replay_audit.screenings.schemas import ScreeningCreate, ScreeningRead
from replay_audit.screenings.sweep.plan import DEFAULT_TP_DEGREE, Platform, ScreenConfig, build_plan
from replay_audit.screenings.sweep.report import ScreeningReport
from replay_audit.worker.checkpoint import CheckpointIndex, CheckpointShape, ModelNotFound

#: The job's dotted path: resolved on the worker, so the API process never imports torch.
JOB = "replay_audit.screenings.tasks.run_screening_job"


#: Where the plan's size is counted: every knob value available (an upper bound of the runs).
_EVERYTHING: Final = Platform(
    "cuda", sm="9.0", flash_attn_installed=True, devices=DEFAULT_TP_DEGREE
)


#: The one way a screening job is named and enqueued (`queue.long_job_spec`).
job_spec = partial(long_job_spec, JOB, "screening")


def check_work(request: ScreeningCreate, shape: CheckpointShape, budget: WorkBudget) -> None:
    """A FieldError naming the field unless every prompt fits the checkpoint (ids within its
    vocabulary; prompt tokens + `max_new_tokens` within its context) and the screening's work,
    the token positions of every prompt (prompt + output) in every run of its plan (a batch
    run counted per copy), is at most `budget` (docs/screening.md, "Bounded work").
    Texts are tokenized one at a time, after bounds that need no tokenizing (a text has at
    least its UTF-8 length over `shape.bytes_per_token` tokens), so a refused request costs
    little."""
    n = request.max_new_tokens
    plan = build_plan(
        _EVERYTHING,
        reference=ScreenConfig(request.reference_dtype or "fp32"),
        knobs=request.knobs,
        tp_degree=request.tp_degree,
        pair=request.pair,
    )
    copies = sum(r.config.batch_size for r in plan.runs())

    def over_budget(tokens: int) -> None:
        if tokens * copies > budget.tokens:
            raise FieldError(
                f"prompts: at least {tokens * copies} token positions ({tokens} per run, "
                f"{copies} runs) exceed {budget.setting} ({budget.tokens}); "
                "send fewer or shorter prompts, fewer knobs or a smaller max_new_tokens",
                field="prompts",
            )

    fields = [
        f"prompts[{i}].{'prompt' if p.prompt else 'prompt_token_ids'}"
        for i, p in enumerate(request.prompts)
    ]
    floors = []
    for field, p in zip(fields, request.prompts, strict=True):
        if p.prompt is None:
            floors.append(len(p.prompt_token_ids or ()))
        elif shape.tokenizer is None:
            message = "the checkpoint has no tokenizer.json; give prompt_token_ids"
            raise FieldError(f"{field}: {message}", field=field)
        else:
            floors.append(len(p.prompt.encode()) // shape.bytes_per_token)
            if floors[-1] + n > shape.context:
                message = f"longer than the checkpoint's context of {shape.context} tokens"
                raise FieldError(f"{field}: {message}", field=field)
    over_budget(sum(floors) + n * len(floors))
    tokens = 0
    for field, p in zip(fields, request.prompts, strict=True):
        ids = p.prompt_token_ids or []
        if p.prompt is not None and shape.tokenizer is not None:
            ids = shape.tokenizer.encode(p.prompt).ids
        refusal = shape.prompt_refusal(ids, n)
        if refusal is not None:
            raise FieldError(f"{field}: {refusal}", field=field)
        tokens += len(ids) + n
    over_budget(tokens)


def create_screening(
    session: Session,
    project_id: int,
    request: ScreeningCreate,
    queue: JobQueue,
    checkpoints: CheckpointIndex,
    budget: WorkBudget,
) -> tuple[Screening, bool]:
    """Store a screening and enqueue its job after commit. Returns (screening, created): an
    `idempotency_key` already used in the project returns the existing one. The checkpoint
    must be in this process's `REPLAY_AUDIT_MODEL_DIRS`: its config.json and tokenizer bound
    the work (`check_work`)."""
    key = request.idempotency_key
    existing = key and repository.get_by_idempotency_key(session, project_id, key)
    if existing:
        return existing, False
    refusal = target_refusal(queue.capabilities, lm_head_dtype=None, device=request.device)
    if refusal is not None:
        raise FieldError(refusal, field="device")
    try:
        shape = checkpoints.shape(request.model_sha256)
    except ModelNotFound as e:
        raise FieldError(f"model_sha256: {e}", field="model_sha256") from None
    check_work(request, shape, budget)
    queue.check()
    screening, created = insert_once(
        session,
        Screening(
            public_id=new_public_id("sc"),
            project_id=project_id,
            status="queued",
            model_sha256=request.model_sha256,
            request=request.model_dump(mode="json"),
            idempotency_key=key,
        ),
        "screening",
    )
    if created:
        queue.enqueue(session, [job_spec(screening, queue.job_timeout_s, queue.default_queue)])
    return screening, created


def get_screening(session: Session, project_id: int, public_id: str) -> Screening:
    """The project's screening, or NotFound (another project's answers the same)."""
    return repository.get_by_public_id(session, project_id, public_id, f"no screening {public_id}")


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
