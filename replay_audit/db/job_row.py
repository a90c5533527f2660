"""The life of a row a job owns (a screening, a verification, a replay job): each run of the
job claims one attempt on it, and a job that cannot go on fails it saying why. Jobs are retried
and may be re-enqueued by `reconcile`, so a finished row is left alone and the attempts are
capped.

A running job holds a lease on its row (`lease_until`, taken with the attempt, renewed by a
thread while it runs, cleared when it ends): a second start while the lease lives backs off,
so a job Redis lost and the reconciler enqueued again, or one RQ delivered twice, never runs
twice at once; a killed worker's lease lapses within `LEASE_S`."""

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
from sqlalchemy.orm import Session

from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope

log = logging.getLogger(__name__)

#: Seconds a lease lasts past its last renewal: how long a dead worker's row stays held (as
#: long as its liveness key, `queue.state.ALIVE_TTL_S`, give or take a renewal: a SIGKILLed
#: worker's replay job is taken again within seconds, not minutes).
LEASE_S: Final = 20
#: Seconds between renewals (well inside `LEASE_S`: a database blip may cost two).
LEASE_RENEW_S: Final = 5.0
#: Seconds between tries of a job while the database or Redis is away (the last repeated).
OUTAGE_BACKOFF_S: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 15.0)
#: Seconds a job waits out such an outage before its error is raised.
OUTAGE_PATIENCE_S: Final = 600.0
#: Characters of an error kept on a row.
MAX_ROW_ERROR_CHARS: Final = 2000


class LeasedRow(Protocol):
    """What every job's row has (a replay job's too): its attempts, the last one's error, and
    the lease of the job running it."""

    id: int
    status: str
    attempts: int
    error: str | None
    lease_until: datetime | None


class JobRow(LeasedRow, Protocol):
    """The row of a request run as one job (a screening, a verification), with its times."""

    started_at: datetime | None
    finished_at: datetime | None


Row = TypeVar("Row", bound=JobRow)
Leased = TypeVar("Leased", bound=LeasedRow)


def claim_attempt(row: JobRow | None, max_attempts: int) -> bool:
    """Start one more attempt on `row` (running, its start time kept from the first). False,
    with nothing to run, when the row is gone or finished, or has used its `max_attempts`
    (then it is failed, saying so: a worker killed or crashing every time)."""
    if row is None or row.status in ("done", "failed") or held_elsewhere(row):
        return False
    if row.attempts >= max_attempts:
        row.status, row.finished_at = "failed", utcnow()
        row.error = give_up_message(row.attempts, row.error)
        return False
    row.attempts += 1
    row.status = "running"
    row.started_at = row.started_at or utcnow()
    take_lease(row)
    return True


def claim_row(session: Session, model: type[Row], row_id: int, max_attempts: int) -> Row | None:
    """Row `row_id` of `model` with one more attempt claimed on it (`claim_attempt`), else None:
    nothing to run. The row is locked for the claiming transaction (PostgreSQL `FOR UPDATE`;
    SQLite's write transactions are serialised, `db.engine`), so of two starts at the same
    moment the second reads the first's lease and backs off."""
    row = session.get(model, row_id, with_for_update=True)
    return row if claim_attempt(row, max_attempts) else None


def give_up_message(attempts: int, last_error: str | None) -> str:
    """What a row failed after its `attempts` says: what the last one raised (`recording_errors`
    kept it), else that a worker died without a word."""
    last = f"; the last said {last_error}" if last_error else " (worker killed or crashing)"
    return f"gave up after {attempts} attempts{last}"[:MAX_ROW_ERROR_CHARS]


def lease_live(row: LeasedRow) -> bool:
    """Whether a running job holds `row` now (its lease has not lapsed)."""
    return row.status == "running" and row.lease_until is not None and row.lease_until > utcnow()


def held_elsewhere(row: LeasedRow) -> bool:
    """Whether another start of the job holds `row` now (`lease_live`), said in the log: the
    caller starts nothing and claims no attempt."""
    if not lease_live(row):
        return False
    log.warning("%s %d runs elsewhere (its lease lives): not started", type(row).__name__, row.id)
    return True


def take_lease(row: LeasedRow) -> None:
    """Hold `row` for the job starting on it now, in the claiming transaction (its body then
    runs inside `leased`, which renews and clears it)."""
    row.lease_until = utcnow() + timedelta(seconds=LEASE_S)


@contextlib.contextmanager
def leased(url: str, model: type[Any], row_id: int) -> Iterator[None]:
    """Hold the lease on row `row_id` of `model` (taken with its attempt, `take_lease`) while
    the block runs: renewed every `LEASE_RENEW_S` by a thread, cleared when the block ends,
    however."""
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
def recording_errors(url: str, model: type[Leased], row_id: int) -> Iterator[None]:
    """Keep what fails an attempt on row `row_id`'s `error` (its status left as it is), for
    the give-up of `claim_attempt` to name: a worker killed without a word leaves nothing, and
    then the give-up says so. Where the database is what failed it (an outage that outlasted
    the job's patience, `outlasting_outages`), the error is written once it is back, waiting
    out the outage as long again. Best effort: the attempt's own error is what propagates."""
    try:
        yield
    except Exception as e:
        message = f"{type(e).__name__}: {e}"[:MAX_ROW_ERROR_CHARS]

        def record() -> None:
            with session_scope(url) as s:
                row = s.get(model, row_id)
                if row is not None and row.status == "running":
                    row.error = message

        try:
            outlasting_outages(record, f"recording {model.__name__} {row_id}'s error")
        except Exception:  # the database is still away, or broken
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
