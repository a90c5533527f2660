"""The verification job: what a worker executes for one `verifications` row.

It reloads the traces the request selected, finds the checkpoint they claim
(`REPLAY_AUDIT_MODEL_DIRS`), takes each claim's calibration from `verification_calibrations`
(measuring the benign null on this worker's platform once, when there is none), runs
`verifications.run.verify` and stores the report. Idempotent: a done or failed verification is
left alone, a calibration is unique per (checkpoint, platform, claim, false-alarm rate), so a
retry reuses what an earlier attempt measured. Workers only: it reaches the torch engine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from sqlalchemy.exc import IntegrityError

from replay_audit.config import BUNDLED_MODEL_DIR, Settings
from replay_audit.db.base import utcnow
from replay_audit.db.job_row import (
    claim_row,
    fail_row,
    leased,
    outlasting_outages,
    recording_errors,
)
from replay_audit.db.unit_of_work import session_scope
from replay_audit.engine.pool import EnginePool
from replay_audit.exceptions import EngineError, ReplayAuditError
from replay_audit.replays.repository import logged_trace, traces_by_id
from replay_audit.stats.verification import CALIBRATION_VERSION, Calibration, Claim, PlatformKey
from replay_audit.verifications import repository
from replay_audit.verifications.domain import (
    claimed_target,
    cover_platforms,
    group_name,
    platform_label,
    report_json,
)
from replay_audit.verifications.models import Verification, VerificationCalibration
from replay_audit.verifications.schemas import VerificationCreate
from replay_audit.worker.checkpoint import ModelNotFound, find_checkpoint
from replay_audit.worker.context import worker_context

log = logging.getLogger(__name__)

#: A verification started this many times without finishing is failed for good.
MAX_ATTEMPTS: Final = 3


@dataclass(frozen=True)
class NullShape:
    """The null a worker measures (`Settings.verify_null_*`): these prompts' texts, generated
    this long."""

    prompts: tuple[str, ...]
    max_new_tokens: int

    @classmethod
    def of(cls, settings: Settings) -> NullShape:
        """`EngineError` naming the setting where its prompts file cannot give prompts."""
        path = settings.verify_null_prompts_file or BUNDLED_MODEL_DIR.parent / "prompts.jsonl"
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
            rows = [json.loads(line) for line in lines if line.strip()]
            texts = tuple(str(r["prompt"]) for r in rows[: settings.verify_null_prompts])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise EngineError(
                f"REPLAY_AUDIT_VERIFY_NULL_PROMPTS_FILE ({path}): no JSON lines with a "
                f'"prompt" each: {type(e).__name__}: {e}'
            ) from e
        if len(texts) < 2:
            raise EngineError(
                f"REPLAY_AUDIT_VERIFY_NULL_PROMPTS_FILE ({path}) holds {len(texts)} prompts: a "
                "null needs at least 2"
            )
        return cls(texts, settings.verify_null_max_new_tokens)

    def measured(self, cal: Calibration) -> bool:
        """Whether `cal` is a null of this shape (one of another, or unrecorded, is not)."""
        return (cal.null_prompts, cal.null_max_new_tokens) == (
            len(self.prompts),
            self.max_new_tokens,
        )


#: measure(model_dir, claim, false_alarm_rate, pool, device, shape) -> the claim's calibration.
Measure = Callable[[Path, Claim, float, EnginePool, str | None, NullShape], Calibration]


def measure_null(
    model_dir: Path,
    claim: Claim,
    rate: float,
    pool: EnginePool,
    device: str | None,
    shape: NullShape,
) -> Calibration:
    """The benign null of `claim` on this worker (`null.benign_null` on `shape`'s prompts)."""
    from replay_audit.screenings.sweep.outputs import PromptRow
    from replay_audit.screenings.sweep.worker import TorchFacts
    from replay_audit.verifications.null import benign_null

    rows: list[PromptRow] = [
        {"id": f"null-{i}", "prompt": text} for i, text in enumerate(shape.prompts)
    ]
    prompts = TorchFacts(model_dir, device).prompts(rows)
    return benign_null(
        model_dir,
        claimed_target(claim),
        prompts,
        pool=pool,
        device=device,
        max_new_tokens=shape.max_new_tokens,
        false_alarm_rate=rate,
        sampling=claim.get("sampling"),
    )


def scanning_platform(
    model_dir: Path, claim: Claim, pool: EnginePool, device: str | None
) -> PlatformKey:
    """This worker's platform as a calibration names it (`null.platform_key`), its GPUs
    counted as its pool owns them (as `benign_null` counts them)."""
    from replay_audit.replays.pipeline import load_arm
    from replay_audit.screenings.sweep.worker import TorchFacts
    from replay_audit.verifications.null import platform_key

    env = load_arm(claimed_target(claim), pool, model_dir).engine.environment()
    facts = TorchFacts(model_dir, device, devices=pool.devices)
    return platform_key(facts.platform(), env["torch_version"])


#: How the jobs run in the current context measure a null (a test binds a smaller one).
_measure: ContextVar[Measure | None] = ContextVar("replay_audit_verification_null", default=None)


def install_null_measure(measure: Measure | None) -> None:
    """Measure nulls with `measure` in the current context from here on (None: `measure_null`)."""
    _measure.set(measure)


def _canonical(value: Mapping[str, object]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class _Calibrations:
    """Each claim's calibration: stored, or measured here and stored (once)."""

    def __init__(self, url: str, sha: str, model_dir: Path, rate: float, device: str | None):
        self.url, self.sha, self.model_dir = url, sha, model_dir
        self.rate, self.device = rate, device
        self.pool = worker_context().pool
        self.shape = NullShape.of(worker_context().settings)
        self.used: list[tuple[Calibration, bool, PlatformKey]] = []

    def __call__(self, claim: Claim) -> Calibration:
        platform = scanning_platform(self.model_dir, claim, self.pool, self.device)
        key = (self.sha, _canonical(platform), _canonical(claim), self.rate)
        with session_scope(self.url) as s:
            row = repository.get_calibration(s, *key)
            stored = Calibration.from_json(row.calibration) if row is not None else None
        # A stale one (an older method's thresholds, or a null of another shape) is replaced.
        stale = stored is not None and (
            stored.version < CALIBRATION_VERSION or not self.shape.measured(stored)
        )
        if stored is None or stale:
            stored = None
            measure = _measure.get() or measure_null
            cal = measure(self.model_dir, claim, self.rate, self.pool, self.device, self.shape)
            try:
                with session_scope(self.url) as s:
                    if stale:
                        repository.replace_calibration(s, *key, cal.to_json())
                    else:
                        repository.add_calibration(
                            s,
                            VerificationCalibration(
                                weights_sha256=self.sha,
                                platform_key=key[1],
                                claim_key=key[2],
                                false_alarm_rate=self.rate,
                                calibration=cal.to_json(),
                            ),
                        )
            except IntegrityError:  # another job stored it first: same null, keep ours
                pass
        self.used.append((stored or cal, stored is not None, platform))
        return stored or cal


def calibration_json(cal: Calibration, reused: bool) -> dict[str, Any]:
    """A calibration's figures as the report shows them."""
    return {
        "claim": cal.claim,
        "platform": cal.platform,
        "false_alarm_rate": cal.false_alarm_rate,
        "statistic": cal.statistic,
        "tokens_needed": cal.tokens_needed(),
        "reach": cal.reach,
        "decision": cal.decision,
        "budgets": [asdict(b) for b in cal.budgets[cal.statistic]],
        "rule": [asdict(r) for r in cal.rule],
        "choices": [asdict(c) for c in cal.choices],
        "variations": [
            {"name": v.name, "traces": v.traces, "tokens": v.tokens} for v in cal.variations
        ],
        "alternative": asdict(cal.alternative) if cal.alternative is not None else None,
        "notes": list(cal.notes),
        "reused": reused,
    }


def run_verification_job(verification_id: int, database_url: str | None = None) -> None:
    """Run verification `verification_id` and store its report (a done one is left alone)."""
    ctx = worker_context()
    url = database_url or ctx.settings.database_url
    with session_scope(url) as s:
        row = claim_row(s, Verification, verification_id, MAX_ATTEMPTS)
        if row is None:
            return
        request = VerificationCreate.model_validate(row.request)
        ids: list[int] = list(row.selection["trace_ids"])  # type: ignore[arg-type]
        groups: list[str] = list(row.selection["groups"])  # type: ignore[arg-type]
        sha = row.model_sha256
    with (
        leased(url, Verification, verification_id),
        recording_errors(url, Verification, verification_id),
    ):
        body = lambda: _verify(verification_id, url, request, ids, groups, sha)  # noqa: E731
        outlasting_outages(body, f"verification {verification_id}")


def _verify(
    verification_id: int,
    url: str,
    request: VerificationCreate,
    ids: list[int],
    groups: list[str],
    sha: str,
) -> None:
    ctx = worker_context()
    try:
        model_dir = find_checkpoint(sha, ctx.settings.model_dirs)
    except ModelNotFound as e:
        fail_row(url, Verification, verification_id, str(e))
        return
    with session_scope(url) as s:
        rows = traces_by_id(s, ids)
        kept = [(i, g) for i, g in zip(ids, groups, strict=True) if i in rows]
        traces = [logged_trace(rows[i]) for i, _ in kept]
        names: list[str | None] = [rows[i].public_id for i, _ in kept]
        configs = [rows[i].config for i, _ in kept]
        logged_on = [platform_label(c.device, c.gpu_name) for c in configs]
    if not traces:
        gone = "none of the selected traces exists any more (retention)"
        fail_row(url, Verification, verification_id, gone)
        return
    from replay_audit.verifications.run import verify
    from replay_audit.verifications.scan import trace_claim

    try:
        calibrations = _Calibrations(url, sha, model_dir, request.false_alarm_rate, request.device)
        result = verify(
            traces, model_dir, ctx.pool, calibrations, names=names, group_of=[g for _, g in kept]
        )
    except ReplayAuditError as e:
        fail_row(url, Verification, verification_id, e.message)
        return
    except (RuntimeError, ValueError, MemoryError, OSError) as e:  # engine-side failure
        log.exception("verification %d failed", verification_id)
        fail_row(url, Verification, verification_id, f"{type(e).__name__}: {e}")
        return
    by_group: dict[str, list[str]] = {}
    for (_, label), trace, logged in zip(kept, traces, logged_on, strict=True):
        by_group.setdefault(group_name(label, trace_claim(trace)), []).append(logged)
    scanning = calibrations.used[0][2] if calibrations.used else None
    here = platform_label(scanning["device"], scanning["gpu_name"]) if scanning else None
    judged = cover_platforms(result.groups, by_group, here)
    report = report_json(judged, result.evidence, result.arms)
    report["scanning_platform"] = scanning
    report["claimed_platforms"] = sorted(set(logged_on))
    report["calibrations"] = [calibration_json(c, reused) for c, reused, _ in calibrations.used]
    if len(kept) < len(ids):
        report["missing_traces"] = len(ids) - len(kept)
    with session_scope(url) as s:
        row = s.get(Verification, verification_id)
        if row is not None:
            row.report = report
            row.status, row.finished_at, row.error = "done", utcnow(), None
