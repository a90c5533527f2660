"""The unit of work: one commit at the end, rollback on error, after-commit hooks."""

from __future__ import annotations

import logging
import threading

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from replay_audit.auth.models import Project
from replay_audit.db.engine import get_engine, get_sessionmaker
from replay_audit.db.unit_of_work import after_commit, session_scope, unit_of_work


def _projects(db_url: str) -> int:
    with session_scope(db_url) as session:
        return int(session.execute(select(func.count()).select_from(Project)).scalar_one())


def _add_project(session: Session, name: str) -> None:
    session.add(Project(name=name))
    session.flush()


def test_commits_once_at_the_end_and_then_runs_hooks(db_url: str) -> None:
    seen: list[int] = []
    with session_scope(db_url) as session:
        _add_project(session, "p")
        after_commit(session, lambda: seen.append(_projects(db_url)))
        assert seen == []  # not before the commit
    assert seen == [1]  # the hook saw the committed row from another session


def test_rollback_on_error_drops_the_hooks(db_url: str) -> None:
    seen: list[str] = []
    with pytest.raises(RuntimeError), session_scope(db_url) as session:
        _add_project(session, "p")
        after_commit(session, lambda: seen.append("ran"))
        raise RuntimeError("boom")
    assert seen == [] and _projects(db_url) == 0


def test_a_failing_hook_is_logged_and_the_others_run(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []

    def broken() -> None:
        raise ValueError("queue down")

    with caplog.at_level(logging.ERROR), unit_of_work(get_sessionmaker(db_url)) as uow:
        _add_project(uow.session, "p")
        uow.after_commit.extend([broken, lambda: seen.append("second")])
    assert seen == ["second"] and _projects(db_url) == 1
    assert "after-commit callback" in caplog.text


def test_after_commit_needs_a_unit_of_work(db_url: str) -> None:
    with Session(get_engine(db_url)) as session, pytest.raises(RuntimeError):
        after_commit(session, lambda: None)


def test_sqlite_connections_are_configured(sqlite_database_url: str) -> None:
    with get_engine(sqlite_database_url).connect() as connection:
        assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert connection.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert int(connection.execute(text("PRAGMA busy_timeout")).scalar() or 0) >= 1000


def test_sqlite_writers_wait_for_each_other_instead_of_failing(
    sqlite_database_url: str,
) -> None:
    """Two units that read then write: BEGIN IMMEDIATE serialises them (no lock upgrade
    deadlock, no 'database is locked')."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work(i: int) -> None:
        try:
            barrier.wait()
            with session_scope(sqlite_database_url) as session:
                session.execute(select(func.count()).select_from(Project)).scalar_one()
                _add_project(session, f"p{i}")
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert errors == [] and _projects(sqlite_database_url) == 4
    finally:
        with session_scope(sqlite_database_url) as session:
            session.execute(text("DELETE FROM projects"))
