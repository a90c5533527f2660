"""Database plumbing shared by every domain: the declarative base, engines, units of work, packed
array column types and public ids. Domain tables live in their package's `models.py`."""

from replay_audit.db.base import Base, utcnow
from replay_audit.db.engine import dispose_engines, get_engine, get_sessionmaker
from replay_audit.db.unit_of_work import UnitOfWork, after_commit, session_scope, unit_of_work

__all__ = [
    "Base",
    "UnitOfWork",
    "after_commit",
    "dispose_engines",
    "get_engine",
    "get_sessionmaker",
    "session_scope",
    "unit_of_work",
    "utcnow",
]
