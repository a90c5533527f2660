"""The declarative base every table derives from.

The naming convention makes every index and constraint name deterministic, so Alembic migrations
can drop and alter them by name on both SQLite (batch mode) and PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar, Final, TypeVar

from pydantic import BaseModel
from sqlalchemy import DateTime, MetaData, TypeDecorator
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Session

NAMING_CONVENTION: Final = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


#: `info` of a constraint or index that exists on one database only (the Alembic environment
#: leaves it out of the comparison on the other): partitioned PostgreSQL tables cannot hold unique
#: keys without the partition key, and SQLite needs a unique index under a foreign key's target.
SQLITE_ONLY: Final[dict[str, tuple[str, ...]]] = {"dialects": ("sqlite",)}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on both databases.

    PostgreSQL stores `timestamptz`; SQLite has no time zone, so values are stored naive in UTC
    and given back their `tzinfo` on the way out. Naive values are refused on the way in: a
    timestamp without a zone is a bug waiting to happen.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; use datetime.now(UTC)")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def utcnow() -> datetime:
    """The current time, timezone-aware in UTC (the only kind stored)."""
    return datetime.now(UTC)


_M = TypeVar("_M", bound=BaseModel)


def read_model(model: type[_M], row: object, **values: Any) -> _M:
    """`model` (a read schema) from `values` and, for each of its other fields, `row`'s
    attribute of the same name: the fields a schema copies from its row are named once, in it."""
    return model(**{f: getattr(row, f) for f in model.model_fields if f not in values}, **values)


def flush_unique(session: Session, *rows: object) -> bool:
    """Add `rows` and flush them in a savepoint: False, with nothing written, when a unique
    constraint refuses them because a concurrent request wrote the same key first (PostgreSQL
    waits for that transaction to commit, then raises UniqueViolation). The caller answers with
    the row that won, or a 409, never a 500. Pending changes made before the call are flushed
    outside the savepoint: after False the session is usable only if there were none."""
    try:
        with session.begin_nested():
            session.add_all(rows)
    except IntegrityError as e:
        code = getattr(e.orig, "sqlstate", None)  # psycopg; sqlite3 has only the message
        if code != "23505" and "UNIQUE constraint failed" not in str(e.orig):
            raise
        return False
    return True


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UTCDateTime()}
