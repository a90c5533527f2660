"""The database a command works on: reachable and at the schema this release needs, or one line
on stderr saying what is wrong and what to run, and exit code 2 (never a traceback).

The embedded default (a SQLite file under ./var/) needs no set-up step, so a command applies
its migrations itself, as `serve` does. A PostgreSQL schema is the operator's: a command names
`replay-audit db upgrade` instead of changing it behind their back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:
    from replay_audit.config import Settings

#: Where a user sets the database, named in every message about it.
URL_VARIABLE = "REPLAY_AUDIT_DATABASE_URL"


def fail(message: str) -> NoReturn:
    """`error: <message>` on stderr, exit code 2."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=2)


def shown_url(url: str) -> str:
    """The URL as it may be printed: the password masked."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line.removeprefix("connection failed: ").strip()


def describe_database_error(exc: BaseException, url: str) -> str | None:
    """One line for an error that says the database cannot be used (unreachable, refused, not a
    database, a missing directory); None for anything else (a bug keeps its traceback)."""
    from alembic.util.exc import CommandError
    from sqlalchemy.exc import DatabaseError, DBAPIError, InterfaceError, OperationalError

    from replay_audit.db.engine import is_sqlite

    where = f"the database {shown_url(url)}"
    if isinstance(exc, OSError):  # the SQLite file's directory could not be made
        reason = exc.strerror or str(exc)
        path = f": {exc.filename}" if exc.filename else ""
        return f"cannot open {where} ({reason}{path}); check {URL_VARIABLE}"
    if isinstance(exc, CommandError):  # e.g. a revision this release does not know
        return f"cannot migrate {where} ({_first_line(str(exc))}); is it from a newer release?"
    # Not DatabaseError's subclasses (a constraint, bad data): those are bugs. DatabaseError
    # itself is SQLite's "file is not a database".
    if isinstance(exc, OperationalError | InterfaceError) or type(exc) is DatabaseError:
        assert isinstance(exc, DBAPIError)
        reason = _first_line(str(exc.orig))
        if is_sqlite(url):
            return f"cannot open {where} ({reason}); check {URL_VARIABLE}"
        return (
            f"cannot connect to {where} ({reason}); check {URL_VARIABLE} and that the server "
            "is running"
        )
    return None


@contextmanager
def database_errors(url: str) -> Iterator[None]:
    """Turn a database that cannot be used into one line and exit code 2."""
    try:
        yield
    except Exception as exc:
        message = describe_database_error(exc, url)
        if message is None:
            raise
        fail(message)


def ready_database(settings: Settings, *, migrate: bool | None = None) -> None:
    """Make sure the configured database answers and has this release's schema, or fail in one
    line. `migrate=None` (most commands): apply the migrations on SQLite, require them on
    PostgreSQL; `True` (`serve`, `demo`): apply them on any database; `False`: require them."""
    from replay_audit.db import migration
    from replay_audit.db.engine import is_sqlite

    url = settings.database_url
    head = migration.head_revision()
    with database_errors(url):
        current = migration.current_revision(url)
        if current == head:
            return
        if migrate or (migrate is None and is_sqlite(url)):
            migration.upgrade(url)
            return
    fail(
        f"the database {shown_url(url)} is at revision {current or 'none (no tables yet)'}, "
        f"this release needs {head}: run `replay-audit db upgrade`"
    )
