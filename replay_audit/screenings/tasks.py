"""The screening job: what a worker executes for one `screenings` row.

Idempotent and resumable: every prompt decoded in a run, every finished run and every probe
the screening produces is stored in `screening_outputs` as it is done (each in its own
transaction), so a killed or re-run job continues from them, within a run at its first prompt
not decoded yet; a done screening is left alone. The job runs on a worker that has the
checkpoint (`REPLAY_AUDIT_MODEL_DIRS`) and reaches the torch engine there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Protocol

from replay_audit.db.base import utcnow
from replay_audit.db.job_row import (
    claim_row,
    fail_row,
    leased,
    outlasting_outages,
    recording_errors,
)
from replay_audit.db.unit_of_work import session_scope
from replay_audit.exceptions import EngineError, ReplayAuditError
from replay_audit.formats import BodyDType
from replay_audit.json_value import JsonObject
from replay_audit.screenings import repository
from replay_audit.screenings.models import Screening
from replay_audit.screenings.schemas import ScreeningCreate
from replay_audit.screenings.sweep.analysis import build_report
from replay_audit.screenings.sweep.outputs import PromptRow, ScreenPrompt
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig, build_plan
from replay_audit.screenings.sweep.runner import run_screening
from replay_audit.worker.checkpoint import CheckpointShape, ModelNotFound, find_checkpoint
from replay_audit.worker.context import worker_context

log = logging.getLogger(__name__)

#: A screening started this many times without finishing is failed for good: a worker killed
#: or timed out twice on it (REPLAY_AUDIT_JOB_TIMEOUT_S each) will not fare better a third time.
MAX_ATTEMPTS = 3


class CheckpointFacts(Protocol):
    """What a screening job needs to know of the checkpoint on the worker's device, besides
    its engines (those come from the worker's engine pool, through the replay pipeline):
    its platform, its own dtype and eos ids, which configurations it cannot run, prompts."""

    def platform(self) -> Platform: ...

    def eos_ids(self) -> list[int]: ...

    def reference_dtype(self) -> BodyDType: ...

    def availability(self, config: ScreenConfig) -> str | None:
        """Why `config` cannot run on this device, found by trying it (the plan's probe)."""
        ...

    def prompts(self, rows: Sequence[PromptRow]) -> list[ScreenPrompt]: ...


FactsFactory = Callable[[Path, str | None], CheckpointFacts]


def _torch_facts(model_dir: Path, device: str | None) -> CheckpointFacts:
    """`screening.worker.TorchFacts`, imported here: only a worker running the job needs it.
    A tensor-parallel group may span the worker's pool's devices (its one TP group)."""
    from replay_audit.screenings.sweep.worker import TorchFacts

    return TorchFacts(model_dir, device, devices=worker_context().pool.devices)


#: The facts factory of the screening jobs run in the current context (a thread's, or an
#: in-process runner's copy of its builder's): bound by a test, never process-wide.
_factory: ContextVar[FactsFactory | None] = ContextVar("replay_audit_screening_facts", default=None)


def install_facts_factory(factory: FactsFactory | None) -> None:
    """Use `factory(model_dir, device)` for the checkpoint facts of the screenings run from
    here on in the current context (tests pass fakes; an in-process runner built afterwards
    inherits it); None: the torch ones. Engines are not here: they come from the worker
    context's engine pool (`replays.tasks.WorkerContext`), the one engine seam."""
    _factory.set(factory)


class DbStore:
    """The runner's `Store` in `screening_outputs`, one transaction per write."""

    def __init__(self, url: str, screening_id: int) -> None:
        self.url = url
        self.screening_id = screening_id

    def get(self, key: str) -> JsonObject | None:
        with session_scope(self.url) as s:
            return repository.get_output(s, self.screening_id, key)

    def scan(self, prefix: str) -> list[JsonObject]:
        with session_scope(self.url) as s:
            return repository.outputs_with_prefix(s, self.screening_id, prefix)

    def put(self, key: str, value: JsonObject) -> None:
        with session_scope(self.url) as s:
            repository.put_output(s, self.screening_id, key, value)
            row = s.get(Screening, self.screening_id)
            if row is not None:
                row.updated_at = utcnow()  # the heartbeat


def run_screening_job(screening_id: int, database_url: str | None = None) -> None:
    """Run (or resume) screening `screening_id` and store its report."""
    ctx = worker_context()
    url = database_url or ctx.settings.database_url
    with session_scope(url) as s:
        row = claim_row(s, Screening, screening_id, MAX_ATTEMPTS)
        if row is None:
            return
        request = ScreeningCreate.model_validate(row.request)
        sha = row.model_sha256
    with leased(url, Screening, screening_id), recording_errors(url, Screening, screening_id):
        body = lambda: _screen(screening_id, url, request, sha)  # noqa: E731
        outlasting_outages(body, f"screening {screening_id}")


def _screen(screening_id: int, url: str, request: ScreeningCreate, sha: str) -> None:
    ctx = worker_context()
    try:
        model_dir = find_checkpoint(sha, ctx.settings.model_dirs)
        shape = CheckpointShape.read(model_dir)
    except ModelNotFound as e:
        fail_row(url, Screening, screening_id, str(e))
        return
    factory = _factory.get() or _torch_facts
    try:
        backend = factory(model_dir, request.device)
        plan = build_plan(
            backend.platform(),
            reference=ScreenConfig(request.reference_dtype or backend.reference_dtype()),
            knobs=request.knobs,
            tp_degree=request.tp_degree,
            pair=request.pair,
            tau=request.tau,
            tau_ulps=request.tau_ulps,
            max_new_tokens=request.max_new_tokens,
            cover=request.cover,
            probe=backend.availability,
        )
        prompts = backend.prompts([p.row() for p in request.prompts])
        for prompt in prompts:  # the API checked; this tokenizer is the one that counts
            refusal = shape.prompt_refusal(prompt.token_ids, request.max_new_tokens)
            if refusal is not None:
                raise EngineError(f"prompt {prompt.id}: {refusal}")
        outputs = run_screening(
            plan,
            prompts,
            ctx.pool,
            model_dir,
            backend.eos_ids(),
            DbStore(url, screening_id),
            worker_kind=ctx.gpu_kind,
        )
        report = build_report(plan, prompts, outputs, model=model_dir.name, weights_sha256=sha)
    except ReplayAuditError as e:
        fail_row(url, Screening, screening_id, e.message)
        return
    except (RuntimeError, ValueError, LookupError, MemoryError) as e:  # engine-side failure
        log.exception("screening %d failed", screening_id)
        fail_row(url, Screening, screening_id, f"{type(e).__name__}: {e}")
        return
    with session_scope(url) as s:
        row = s.get(Screening, screening_id)
        if row is not None:
            row.report = report.model_dump(mode="json")
            row.status, row.finished_at, row.error = "done", utcnow(), None
