"""The life of a row a job owns (a screening, a verification): each run of the job claims one
attempt on it, and a job that cannot go on fails it saying why. Jobs are retried and may be
re-enqueued by `reconcile`, so a finished row is left alone and the attempts are capped.

A running job holds a lease on its row (`lease_until`, renewed by a thread while it runs,
cleared when it ends): a second start while the lease lives backs off, so a job Redis lost
and the reconciler enqueued again never runs twice at once; a killed worker's lease lapses
within `LEASE_S`."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any, Final, Protocol, TypeVar

from sqlalchemy import update
from sqlalchemy.exc import SQLAlchemyError

from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope

log = logging.getLogger(__name__)

#: Seconds a lease lasts past its last renewal: how long a dead worker's row stays held.
LEASE_S: Final = 60
#: Seconds between renewals (well inside `LEASE_S`: a database blip may cost one).
LEASE_RENEW_S: Final = 10.0
#: Seconds between tries of a job while the database or Redis is away (the last repeated).
OUTAGE_BACKOFF_S: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 15.0)
#: Seconds a job waits out such an outage before its error is raised.
OUTAGE_PATIENCE_S: Final = 600.0
#: Characters of an error kept on a row.
MAX_ROW_ERROR_CHARS: Final = 2000


class JobRow(Protocol):
    id: int
    status: str
    attempts: int
    error: str | None
    started_at: datetime | None
    finished_at: datetime | None
    lease_until: datetime | None


Row = TypeVar("Row", bound=JobRow)


def claim_attempt(row: JobRow | None, max_attempts: int) -> bool:
    """Start one more attempt on `row` (running, its start time kept from the first). False,
    with nothing to run, when the row is gone or finished, or has used its `max_attempts`
    (then it is failed, saying so: a worker killed or crashing every time)."""
    if row is None or row.status in ("done", "failed"):
        return False
    if lease_live(row):
        log.warning(
            "%s %d runs elsewhere (its lease lives): not started", type(row).__name__, row.id
        )
        return False
    if row.attempts >= max_attempts:
        row.status, row.finished_at = "failed", utcnow()
        last = f"; the last said {row.error}" if row.error else " (worker killed or crashing)"
        row.error = f"gave up after {row.attempts} attempts{last}"[:MAX_ROW_ERROR_CHARS]
        return False
    row.attempts += 1
    row.status = "running"
    row.started_at = row.started_at or utcnow()
    row.lease_until = utcnow() + timedelta(seconds=LEASE_S)
    return True


def lease_live(row: JobRow) -> bool:
    """Whether a running job holds `row` now (its lease has not lapsed)."""
    return row.status == "running" and row.lease_until is not None and row.lease_until > utcnow()


@contextlib.contextmanager
def leased(url: str, model: type[Any], row_id: int) -> Iterator[None]:
    """Hold the lease on row `row_id` of `model` (claimed by `claim_attempt`) while the block
    runs: renewed every `LEASE_RENEW_S` by a thread, cleared when the block ends, however."""
    stop = threading.Event()

    def set_lease(until: datetime | None) -> None:
        with contextlib.suppress(SQLAlchemyError), session_scope(url) as s:  # a blip: lapses
            s.execute(update(model).where(model.id == row_id).values(lease_until=until))

    def renew() -> None:
        while not stop.wait(LEASE_RENEW_S):
            set_lease(utcnow() + timedelta(seconds=LEASE_S))

    thread = threading.Thread(target=renew, name=f"lease-{model.__name__}-{row_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        set_lease(None)


@contextlib.contextmanager
def recording_errors(url: str, model: type[Row], row_id: int) -> Iterator[None]:
    """Keep what fails an attempt on row `row_id`'s `error` (its status left as it is), for
    the give-up of `claim_attempt` to name: a worker killed without a word leaves nothing, and
    then the give-up says so. Best effort: the attempt's own error is what propagates."""
    try:
        yield
    except Exception as e:
        try:
            with session_scope(url) as s:
                row = s.get(model, row_id)
                if row is not None and row.status == "running":
                    row.error = f"{type(e).__name__}: {e}"[:MAX_ROW_ERROR_CHARS]
        except Exception:  # the database may be what failed it
            log.exception("could not record %s %d's error", model.__name__, row_id)
        raise


def fail_row(url: str, model: type[Row], row_id: int, message: str) -> None:
    """Fail row `row_id` of `model` with `message`, in a transaction of its own (a done row is
    left alone)."""
    with session_scope(url) as s:
        row = s.get(model, row_id)
        if row is not None and row.status != "done":
            row.status, row.error, row.finished_at = "failed", message, utcnow()


def _outages() -> dict[type[Exception], str]:
    """The errors of the database or Redis being away, each with what is away."""
    from redis import exceptions as redis
    from sqlalchemy import exc

    out: dict[type[Exception], str] = {
        exc.OperationalError: "the database",
        exc.InterfaceError: "the database",
        redis.ConnectionError: "Redis",
        redis.TimeoutError: "Redis",
    }
    with contextlib.suppress(ImportError):  # a deployment on SQLite may lack it
        import psycopg

        out[psycopg.OperationalError] = "the database"
    return out


def _sqlite_error(e: Exception) -> bool:
    """An error of SQLite's other than a lock held elsewhere ("no such table"): no outage."""
    import sqlite3

    orig = getattr(e, "orig", None)
    return isinstance(orig, sqlite3.OperationalError) and "locked" not in str(orig)


def outlasting_outages(step: Callable[[], None], what: str) -> None:
    """Run `step` (resumable: a job's body after its claim), and again after a backoff each
    time it fails because the database or Redis is away: in the same attempt, none spent.
    Past `OUTAGE_PATIENCE_S` the error is raised."""
    outages = _outages()
    deadline = time.monotonic() + OUTAGE_PATIENCE_S
    for n in itertools.count():
        try:
            return step()
        except tuple(outages) as e:
            if _sqlite_error(e):
                raise
            wait = OUTAGE_BACKOFF_S[min(n, len(OUTAGE_BACKOFF_S) - 1)]
            if time.monotonic() + wait > deadline:
                raise
            away = next(v for k, v in outages.items() if isinstance(e, k))
            log.warning(
                "%s: %s is away (%s: %s); trying again in %g s, no attempt spent",
                what, away, type(e).__name__, str(e).splitlines()[0], wait,
            )  # fmt: skip
            time.sleep(wait)
