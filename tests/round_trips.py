"""Counting PostgreSQL round trips, from libpq's own protocol trace.

    counter = RoundTrips(engine)        # before the engine's first connection
    ...                                 # requests on that engine
    trips, statements = counter.take()  # since the last take()

A round trip is each time the client sends (one message, or a pipeline of them) and then reads
the server's answer: BEGIN, COMMIT and the pool's ping count as much as a query does. The
statements are the texts the client sent (a prepared statement's text once it is parsed).
"""

from __future__ import annotations

import tempfile
import weakref
from typing import Any

from psycopg import pq
from sqlalchemy import Engine, event


def _text(quoted: str) -> str:
    # The statement's first line (the trace writes a text's line breaks as they are), up to
    # its closing quote: enough to tell statements apart.
    return quoted.strip().removeprefix('"').split('"')[0].strip()


class RoundTrips:
    """Counts the round trips of every connection `engine` opens from now on."""

    def __init__(self, engine: Engine) -> None:
        # Open as long as the counter: libpq writes to it from every traced connection.
        self._file = tempfile.TemporaryFile()  # noqa: SIM115
        self._offset = 0
        self._prepared: dict[str, str] = {}
        self._pgconns: weakref.WeakSet[Any] = weakref.WeakSet()
        event.listen(engine, "connect", self._trace)

    def _trace(self, dbapi_connection: Any, _record: Any) -> None:
        pgconn = dbapi_connection.pgconn
        self._pgconns.add(pgconn)
        pgconn.trace(self._file.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def _flush(self) -> None:
        # libpq writes through a buffered stream; untracing flushes it.
        for pgconn in list(self._pgconns):
            if pgconn.status == pq.ConnStatus.OK:
                pgconn.untrace()
                pgconn.trace(self._file.fileno())
                pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def take(self) -> tuple[int, list[str]]:
        """(round trips, the statements sent) since the last call."""
        self._flush()
        self._file.seek(self._offset)
        lines = self._file.read().decode(errors="replace").splitlines()
        self._offset = self._file.tell()
        trips, sent, statements = 0, False, []
        for line in lines:
            direction, _, kind, body = [*line.split("\t", 3), "", "", ""][:4]
            if direction == "F":
                sent = True
                if kind == "Query":
                    statements.append(_text(body))
                elif kind == "Parse":  # "name" "text" ...
                    name, _, query = body.strip().partition(" ")
                    self._prepared[name] = _text(query)
                elif kind == "Bind":  # "portal" "statement" ...
                    name = body.strip().split(" ")[1]
                    statements.append(self._prepared.get(name, name))
            elif direction == "B" and sent:
                trips, sent = trips + 1, False
        return trips, statements

    def close(self) -> None:
        self._file.close()
