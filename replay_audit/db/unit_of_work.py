"""One transaction, owned by the edge (a request, a job, a CLI command).

Services and repositories never commit: they receive a `Session` and the edge commits once, at
the end, when everything succeeded; any exception rolls the whole unit back.

Work that must only happen once the data is durable (enqueueing a job that will reload the rows
this transaction wrote) goes in the unit's `after_commit` list:

    from replay_audit.db.unit_of_work import after_commit

    def create_replay(session: Session, ...) -> ReplayRun:
        run = ReplayRun(...)
        session.add(run)
        session.flush()
        after_commit(session, lambda: runner.enqueue("replay", run.id))
        return run

The callbacks run in order right after a successful COMMIT, and are dropped, never run, on
rollback, so a job can never see a row that does not exist. A callback that raises is logged and
the others still run: the transaction is committed by then and the caller's answer (e.g. 201)
stays true; whatever the callback was to start must be recoverable from the database.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy.orm import Session, sessionmaker

from replay_audit.db.engine import READ_ONLY_OPTION, get_sessionmaker

logger = logging.getLogger(__name__)

_INFO_KEY = "replay_audit.unit_of_work"

AfterCommit = Callable[[], object]


class UnitOfWork:
    """A session plus the callbacks to run after its commit. Made by `unit_of_work()`."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.after_commit: list[AfterCommit] = []
        #: Exceptions the after-commit callbacks raised (the edge decides what to answer).
        self.callback_errors: list[Exception] = []
        session.info[_INFO_KEY] = self

    def commit(self) -> None:
        """Commit, then run (and clear) the after-commit callbacks."""
        self.session.commit()
        callbacks, self.after_commit = self.after_commit, []
        for callback in callbacks:
            try:
                callback()
            except Exception as e:
                logger.exception("after-commit callback %r failed", callback)
                self.callback_errors.append(e)

    def rollback(self) -> None:
        """Roll back and drop the after-commit callbacks unrun."""
        self.after_commit.clear()
        self.session.rollback()


def after_commit(session: Session, callback: AfterCommit) -> None:
    """Run `callback` after `session`'s unit of work commits (never if it rolls back).

    Raises RuntimeError if the session was not opened by `unit_of_work()` / `session_scope()`:
    a callback nobody would run is a bug, not something to ignore.
    """
    uow = session.info.get(_INFO_KEY)
    if not isinstance(uow, UnitOfWork):
        raise RuntimeError("after_commit() needs a session opened by unit_of_work()")
    uow.after_commit.append(callback)


def open_unit(factory: sessionmaker[Session], *, read_only: bool = False) -> UnitOfWork:
    """A new unit of work; end it with `end_unit`. Without `read_only` this does no I/O (the
    session connects at its first statement). `unit_of_work()` is the usual way in."""
    session = factory()
    if read_only:
        session.connection(execution_options={READ_ONLY_OPTION: True})
    return UnitOfWork(session)


def end_unit(uow: UnitOfWork, error: BaseException | None) -> None:
    """Commit `uow` (`error` None) or roll it back, then close its session."""
    try:
        if error is None:
            uow.commit()
        else:
            uow.rollback()
    finally:
        uow.session.close()


@contextmanager
def unit_of_work(
    factory: sessionmaker[Session], *, read_only: bool = False
) -> Iterator[UnitOfWork]:
    """Open a session; commit once when the block ends normally, roll back if it raises.

    `read_only=True` is a hint for SQLite (a deferred BEGIN that does not take the write lock);
    it is still committed normally, which for a reader just ends the transaction.
    """
    uow = open_unit(factory, read_only=read_only)
    try:
        yield uow
    except BaseException as e:
        end_unit(uow, e)
        raise
    end_unit(uow, None)


@contextmanager
def session_scope(database_url: str | None = None) -> Iterator[Session]:
    """A session for jobs and CLI commands: commit once at the end, roll back on error.

    `database_url` defaults to the configured one (`REPLAY_AUDIT_DATABASE_URL`). Use
    `after_commit(session, ...)` inside it exactly as in a request.
    """
    if database_url is None:
        from replay_audit.config import get_settings

        database_url = get_settings().database_url
    with unit_of_work(get_sessionmaker(database_url)) as uow:
        yield uow.session
