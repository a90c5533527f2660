"""Run the Alembic migrations from code (`replay-audit db upgrade`, `serve`, the tests).

The migrations live in the top-level `migrations/` directory beside the package (the layout the
project fixes), found relative to `replay_audit/__init__.py`: this works from a checkout or an
editable install, which is how the service is deployed (see the Dockerfile).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

import replay_audit
from replay_audit.db.engine import create_db_engine

MIGRATIONS_DIR: Final = Path(replay_audit.__file__).resolve().parent.parent / "migrations"


def alembic_config(database_url: str) -> Config:
    """An Alembic Config pointing at `migrations/` and `database_url` (no alembic.ini needed)."""
    if not MIGRATIONS_DIR.is_dir():
        raise FileNotFoundError(f"migrations directory not found at {MIGRATIONS_DIR}")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Through attributes, not set_main_option: URLs may hold '%' that ConfigParser would
    # try to interpolate.
    config.attributes["database_url"] = database_url
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Apply the migrations up to `revision` (default: the newest)."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    """Revert the migrations down to `revision` ("base" reverts them all)."""
    command.downgrade(alembic_config(database_url), revision)


def head_revision() -> str | None:
    """The newest revision in `migrations/`."""
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(database_url: str) -> str | None:
    """The revision the database is at (None when never migrated)."""
    engine = create_db_engine(database_url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
