"""All SQL of verifications. Never commits: the edge (request, job) does."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from sqlalchemy import select
from sqlalchemy.orm import Session

from replay_audit.db import jobs
from replay_audit.json_value import JsonObject
from replay_audit.traces import repository as traces_repository
from replay_audit.traces.models import NumericalConfigRow, Trace
from replay_audit.traces.selection import TraceSelection
from replay_audit.verifications.models import Verification, VerificationCalibration

get_by_public_id = partial(jobs.get_by_public_id, Verification)
get_by_idempotency_key = partial(jobs.get_by_idempotency_key, Verification)
recent = partial(jobs.recent, Verification)
unfinished = partial(jobs.unfinished, Verification)


def selected_traces(
    session: Session,
    project_id: int,
    selection: TraceSelection,
    limit: int,
    config_ids: Sequence[int] | None = None,
    public_ids: Sequence[str] | None = None,
) -> list[Trace]:
    """Up to `limit` traces in `selection` (and of `config_ids`, and among `public_ids`, when
    given), oldest first, with their configuration (no arrays)."""
    stmt = traces_repository.select_traces(project_id, selection)
    if config_ids is not None:
        stmt = stmt.where(Trace.config_id.in_(list(config_ids)))
    if public_ids is not None:
        stmt = stmt.where(Trace.public_id.in_(list(public_ids)))
    return list(session.scalars(stmt.order_by(None).order_by(Trace.id).limit(limit)))


def known_trace_ids(session: Session, project_id: int, public_ids: Sequence[str]) -> set[str]:
    """Which of `public_ids` are traces of the project."""
    stmt = select(Trace.public_id).where(
        Trace.project_id == project_id, Trace.public_id.in_(list(set(public_ids)))
    )
    return set(session.scalars(stmt))


def configs(session: Session) -> list[tuple[int, str]]:
    """Every numerical configuration's (id, config JSON): few, one per distinct configuration."""
    rows = session.execute(select(NumericalConfigRow.id, NumericalConfigRow.config_json))
    return [(i, j) for i, j in rows]


def get_calibration(
    session: Session, weights_sha256: str, platform_key: str, claim_key: str, rate: float
) -> VerificationCalibration | None:
    return session.scalar(
        select(VerificationCalibration).where(
            VerificationCalibration.weights_sha256 == weights_sha256,
            VerificationCalibration.platform_key == platform_key,
            VerificationCalibration.claim_key == claim_key,
            VerificationCalibration.false_alarm_rate == rate,
        )
    )


def replace_calibration(
    session: Session,
    weights_sha256: str,
    platform_key: str,
    claim_key: str,
    rate: float,
    calibration: JsonObject,
) -> None:
    """Store `calibration` in place of the row of that key (a stale method's)."""
    row = get_calibration(session, weights_sha256, platform_key, claim_key, rate)
    if row is not None:
        row.calibration = calibration
        session.flush()


def add_calibration(session: Session, row: VerificationCalibration) -> None:
    session.add(row)
    session.flush()
