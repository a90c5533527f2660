"""Verifications: create (resolve the selection, store, enqueue the job after commit), read.
Services take a session and never commit."""

from __future__ import annotations

from functools import partial

from sqlalchemy.orm import Session

from replay_audit.config import WorkBudget
from replay_audit.db.base import read_model
from replay_audit.db.ids import new_public_id
from replay_audit.db.jobs import insert_once
from replay_audit.exceptions import FieldError
from replay_audit.queue import Capabilities, JobQueue, long_job_spec
from replay_audit.replays.domain import logging_engine
from replay_audit.replays.service import target_refusal
from replay_audit.traces.models import Trace
from replay_audit.verifications import repository
from replay_audit.verifications.models import Verification
from replay_audit.verifications.schemas import (
    MAX_VERIFICATION_TRACES,
    GroupBy,
    VerificationCreate,
    VerificationRead,
)

#: The job's dotted path: resolved on the worker, so the API process never imports torch.
JOB = "replay_audit.verifications.tasks.run_verification_job"


#: The one way a verification job is named and enqueued (`queue.long_job_spec`).
job_spec = partial(long_job_spec, JOB, "verification")


def group_of(trace: Trace, group_by: GroupBy) -> str:
    """A trace's group: its tags, its logging engine, its configuration's id, or "all"."""
    if group_by == "tag":
        return ",".join(sorted(trace.tags)) or "untagged"
    if group_by == "engine":
        return logging_engine(trace.config.config_json)
    if group_by == "config":
        return trace.config.public_id
    return "all"


def select_traces(
    session: Session,
    project_id: int,
    request: VerificationCreate,
    capabilities: Capabilities,
    budget: WorkBudget | None = None,
) -> list[Trace]:
    """The traces `request` verifies, oldest first, or FieldError saying why it cannot run here
    (nothing is written): a device this deployment cannot run, a filter that selects no trace,
    more than MAX_VERIFICATION_TRACES or more tokens than `budget` (where it runs), trace ids
    that are not the project's, traces claiming more than one checkpoint."""
    refusal = target_refusal(capabilities, lm_head_dtype=None, device=request.device)
    if refusal is not None:
        raise FieldError(refusal, field="device")
    f = request.filter
    config_ids = None
    if f.engine is not None:
        config_ids = [i for i, j in repository.configs(session) if logging_engine(j) == f.engine]
    traces = repository.selected_traces(
        session, project_id, f.to_selection(), MAX_VERIFICATION_TRACES + 1, config_ids, f.trace_ids
    )
    if f.trace_ids is not None:
        unknown = sorted(
            set(f.trace_ids) - repository.known_trace_ids(session, project_id, f.trace_ids)
        )
        if unknown:
            shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            raise FieldError(
                f"{len(unknown)} of trace_ids are not traces of this project: {shown}",
                field="filter.trace_ids",
            )
    if not traces:
        raise FieldError("the filter selects no trace", field="filter")
    if len(traces) > MAX_VERIFICATION_TRACES:
        raise FieldError(
            f"the filter selects more than {MAX_VERIFICATION_TRACES} traces; narrow it",
            field="filter",
        )
    tokens = sum(t.n_prompt_tokens + t.n_output_tokens for t in traces)
    if budget is not None and tokens > budget.tokens:
        raise FieldError(
            f"the filter selects {tokens} tokens (prompts and outputs), more than "
            f"{budget.setting} ({budget.tokens}) where this verification runs; narrow it",
            field="filter",
        )
    checkpoints = {t.weights_sha256 for t in traces}
    if len(checkpoints) > 1:
        raise FieldError(
            f"the selected traces claim {len(checkpoints)} checkpoints; choose one with "
            "filter.weights_sha256",
            field="filter.weights_sha256",
        )
    return traces


def create_verification(
    session: Session,
    project_id: int,
    request: VerificationCreate,
    queue: JobQueue,
    *,
    traces: list[Trace] | None = None,
    budget: WorkBudget | None = None,
) -> tuple[Verification, bool]:
    """Store a verification of the traces its filter selects (resolved now, or `traces`, what
    `select_traces` gave for this request) and enqueue its job after commit. Returns
    (verification, created): an `idempotency_key` already used in the project returns the
    existing one, also when a concurrent request stored it first (a Conflict, 409, only if that
    request's row cannot be read yet)."""
    key = request.idempotency_key
    existing = key and repository.get_by_idempotency_key(session, project_id, key)
    if existing:
        return existing, False
    if traces is None:
        traces = select_traces(session, project_id, request, queue.capabilities, budget)
    queue.check()
    verification, created = insert_once(
        session,
        Verification(
            public_id=new_public_id("ver"),
            project_id=project_id,
            status="queued",
            model_sha256=traces[0].weights_sha256,
            request=request.model_dump(mode="json"),
            selection={
                "trace_ids": [t.id for t in traces],
                "groups": [group_of(t, request.group_by) for t in traces],
            },
            idempotency_key=key,
        ),
        "verification",
    )
    if created:
        queue.enqueue(session, [job_spec(verification, queue.job_timeout_s, queue.default_queue)])
    return verification, created


def get_verification(session: Session, project_id: int, public_id: str) -> Verification:
    """The project's verification, or NotFound (another project's answers the same)."""
    missing = f"no verification {public_id}"
    return repository.get_by_public_id(session, project_id, public_id, missing)


def traces_of(verification: Verification) -> int:
    return len(verification.selection["trace_ids"])  # type: ignore[arg-type]


def to_read(verification: Verification, project: str) -> VerificationRead:
    return read_model(VerificationRead, verification, id=verification.public_id, project=project)


def recent_verifications(session: Session, project_id: int, limit: int = 20) -> list[Verification]:
    return repository.recent(session, project_id, limit)
