"""Alembic environment for replay-audit.

The target comes, in order, from a connection handed in by the caller
(`config.attributes["connection"]`), a URL handed in by the caller
(`config.attributes["database_url"]`, as `replay_audit.db.migration` does), the
`sqlalchemy.url` option, or the service settings (`REPLAY_AUDIT_DATABASE_URL`).
SQLite runs in batch mode (its ALTER TABLE cannot drop or alter columns); PostgreSQL as usual.
"""

from __future__ import annotations

import re
from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import Connection

# Every domain's tables, so that `alembic check` (autogenerate) sees them.
import replay_audit.models  # noqa: F401
from replay_audit.config import get_settings
from replay_audit.db.base import Base
from replay_audit.db.engine import create_db_engine, is_sqlite

config = context.config
target_metadata = Base.metadata

# `alembic ...` from the command line logs as alembic.ini says; called from code (no ini file),
# the caller's logging stays as it is.
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


#: A partition of a partitioned table (replay_audit/db/partition.py names them): its parent is
#: what the models describe, so the partitions and their indexes are left out of `alembic check`.
_PARTITION = re.compile(r"^(traces|trace_tags|replay_results)_(p\d{8}|default)$")


def _include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    return not (type_ == "table" and name is not None and _PARTITION.match(name))


def _include_object_for(dialect: str) -> Any:
    """Leave out of the comparison the model objects meant for the other database (their
    `info["dialects"]`, see replay_audit.db.base.SQLITE_ONLY) and what PostgreSQL derives
    from a foreign key to a partitioned table."""

    def include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ == "foreign_key_constraint" and _PARTITION.match(obj.referred_table.name):
            # PostgreSQL's own per-partition copies of a foreign key to a partitioned table.
            return False
        dialects = getattr(obj, "info", {}).get("dialects") if not reflected else None
        return dialects is None or dialect in dialects

    return include


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_name=_include_name,
        include_object=_include_object_for(connection.dialect.name),
        render_as_batch=connection.dialect.name == "sqlite",
        # SQLite too: our engine emits BEGIN itself (see replay_audit.db.engine), so a failed
        # migration rolls back whole instead of leaving half a schema.
        transactional_ddl=True,
        compare_type=True,
        compare_server_default=True,
    )


def _database_url() -> str:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    return str(url) if url else get_settings().database_url


def run_migrations_offline() -> None:
    url = _database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=is_sqlite(url),
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return

    engine = create_db_engine(_database_url())
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
