"""All SQL of screenings."""

from __future__ import annotations

from functools import partial

from sqlalchemy import select
from sqlalchemy.orm import Session

from replay_audit.db import jobs
from replay_audit.json_value import JsonObject
from replay_audit.screenings.models import Screening, ScreeningOutput

get_by_public_id = partial(jobs.get_by_public_id, Screening)
get_by_idempotency_key = partial(jobs.get_by_idempotency_key, Screening)
recent = partial(jobs.recent, Screening)


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
