"""All SQL of screenings."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from replay_audit.db.base import flush_unique
from replay_audit.json_value import JsonObject
from replay_audit.screenings.models import Screening, ScreeningOutput


def get_by_public_id(session: Session, project_id: int, public_id: str) -> Screening | None:
    return session.scalar(select(Screening).filter_by(project_id=project_id, public_id=public_id))


def get_by_idempotency_key(session: Session, project_id: int, key: str) -> Screening | None:
    return session.scalar(select(Screening).filter_by(project_id=project_id, idempotency_key=key))


def add(session: Session, screening: Screening) -> Screening | None:
    """Insert the screening; None, with nothing inserted, when a concurrent request took its
    idempotency_key."""
    return screening if flush_unique(session, screening) else None


def recent(session: Session, project_id: int, limit: int) -> list[Screening]:
    return list(
        session.scalars(
            select(Screening)
            .where(Screening.project_id == project_id)
            .order_by(Screening.created_at.desc(), Screening.id.desc())
            .limit(limit)
        )
    )


def get_output(session: Session, screening_id: int, key: str) -> JsonObject | None:
    return session.scalar(
        select(ScreeningOutput.value).filter_by(screening_id=screening_id, key=key)
    )


def put_output(session: Session, screening_id: int, key: str, value: JsonObject) -> None:
    """Insert or replace one stored output (a run, a probe, the plan's fingerprint)."""
    row = session.scalar(select(ScreeningOutput).filter_by(screening_id=screening_id, key=key))
    if row is None:
        session.add(ScreeningOutput(screening_id=screening_id, key=key, value=value))
    else:
        row.value = value


def outputs_with_prefix(session: Session, screening_id: int, prefix: str) -> list[JsonObject]:
    """The stored outputs whose key starts with `prefix` (a run's per-prompt decodes)."""
    return list(
        session.scalars(
            select(ScreeningOutput.value).where(
                ScreeningOutput.screening_id == screening_id,
                ScreeningOutput.key.startswith(prefix, autoescape=True),
            )
        )
    )
