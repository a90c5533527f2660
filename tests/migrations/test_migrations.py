"""The migrations build the schema the models describe, and revert cleanly, on both databases.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect

from replay_audit.db import migration


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_db_url(
    request: pytest.FixtureRequest, tmp_path: Path
) -> str:
    """A brand-new, never migrated database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    make: Callable[[], str] = request.getfixturevalue("empty_postgres_database")
    return make()


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(empty_db_url: str) -> None:
    head = migration.head_revision()
    migration.upgrade(empty_db_url)
    assert migration.current_revision(empty_db_url) == head
    tables = _tables(empty_db_url)
    assert {"projects", "api_keys", "numerical_configs", "traces", "trace_tags"} <= tables

    migration.downgrade(empty_db_url, "base")
    assert migration.current_revision(empty_db_url) is None
    assert _tables(empty_db_url) <= {"alembic_version"}

    migration.upgrade(empty_db_url)
    assert migration.current_revision(empty_db_url) == head
    assert _tables(empty_db_url) == tables


def test_each_revision_reverts_one_step(empty_db_url: str) -> None:
    migration.upgrade(empty_db_url, "0001")
    assert migration.current_revision(empty_db_url) == "0001"
    migration.upgrade(empty_db_url)
    migration.downgrade(empty_db_url, "0001")
    assert migration.current_revision(empty_db_url) == "0001"
    migration.downgrade(empty_db_url, "base")
    assert migration.current_revision(empty_db_url) is None


def test_migrated_schema_matches_the_models(empty_db_url: str) -> None:
    """What `alembic check` runs in CI: autogenerate finds nothing left to migrate."""
    migration.upgrade(empty_db_url)
    command.check(migration.alembic_config(empty_db_url))  # raises on any difference
