"""SQL for projects and API keys."""

from __future__ import annotations

from sqlalchemy import exists, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from replay_audit.auth.models import ApiKey, Project
from replay_audit.db.base import utcnow


def get_or_create_project(session: Session, name: str) -> Project:
    """The project called `name`, created if absent (safe against a concurrent creator)."""
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    session.execute(insert(Project).values(name=name, created_at=utcnow()).on_conflict_do_nothing())
    return session.execute(select(Project).where(Project.name == name)).scalar_one()


def get_project(session: Session, name: str) -> Project | None:
    return session.execute(select(Project).where(Project.name == name)).scalar_one_or_none()


def add_api_key(session: Session, key: ApiKey) -> ApiKey:
    session.add(key)
    session.flush()
    return key


def find_api_key_by_lookup(session: Session, lookup: str) -> ApiKey | None:
    return session.execute(select(ApiKey).where(ApiKey.lookup == lookup)).scalar_one_or_none()


def list_api_keys(session: Session, project_id: int) -> list[ApiKey]:
    stmt = select(ApiKey).where(ApiKey.project_id == project_id).order_by(ApiKey.id)
    return list(session.execute(stmt).scalars())


def any_api_key_exists(session: Session) -> bool:
    return bool(session.execute(select(exists().select_from(ApiKey))).scalar())
