"""Log lines that say which request, project, replay run and job they belong to.

    configure_logging("json")          # REPLAY_AUDIT_LOG_FORMAT: one JSON object a line
    with bound(job_id=42):             # every line logged inside carries it
        log.info("...")

The fields live in a `ContextVar`: bound by the API's request middleware (request id), noted by
the key check (project), bound by the runners (job id) and the replay job (run id). A thread
started by asyncio's executor or an in-process runner sees what was bound where it started.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Final, Literal

LogFormat = Literal["text", "json"]

#: The context fields of a log line, in the order a JSON line shows them.
FIELDS: Final = ("request_id", "project", "run_id", "job_id")

#: The context fields bound where this runs: a fresh dict per `bound()` block, so a block's
#: fields never leak into another request's or job's; `note()` adds to it in place.
_fields: ContextVar[dict[str, str] | None] = ContextVar("replay_audit_log_fields", default=None)

#: An incoming X-Request-ID is kept when it looks like an id (a UUID, a trace id), else replaced.
_SANE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def sane_request_id(value: str | None) -> str | None:
    """`value` if it is fit to be logged and echoed back as a request id, else None."""
    return value if value is not None and _SANE_REQUEST_ID.fullmatch(value) else None


def current(name: str) -> str | None:
    """The value of context field `name` (one of FIELDS) where this runs."""
    fields = _fields.get()
    return fields.get(name) if fields is not None else None


@contextmanager
def bound(**values: str | int | None) -> Iterator[None]:
    """Inside the block, the context fields are those bound outside with `values` added (None
    removes one)."""
    fields = {**(_fields.get() or {}), **{k: str(v) for k, v in values.items() if v is not None}}
    for name in [k for k, v in values.items() if v is None]:
        fields.pop(name, None)
    token = _fields.set(fields)
    try:
        yield
    finally:
        _fields.reset(token)


def note(**values: str | int) -> None:
    """Add fields to the innermost `bound()` block, seen by everything that shares it: a
    request's dependency (run in a worker thread, with a copy of the request's context) notes
    the key's project, and the request's access line shows it."""
    fields = _fields.get()
    if fields is not None:
        fields.update({k: str(v) for k, v in values.items()})


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, the process of a
    worker group (`process`, e.g. "2/4") where set, the context fields that are set, and the
    traceback of an exception."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.process is not None:
            line["process"] = self.process
        line |= {name: value for name in FIELDS if (value := current(name)) is not None}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


_TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s %(message)s"


def configure_logging(
    log_format: LogFormat, level: int = logging.INFO, process: str | None = None
) -> None:
    """Send the process's log lines, uvicorn's server log included, to stderr as text or JSON
    lines (its access log: `api.server.uvicorn_logging`). Once, by each entry point. `process`:
    which process of a worker group this is (`worker --processes K`: "1/K" ... "K/K"), shown
    on every line (RQ's own lines too: they go through this handler)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(process))
    elif process is None:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    else:
        tag = process.replace("%", "%%")
        handler.setFormatter(
            logging.Formatter(_TEXT_FORMAT.replace(" %(message)s", f" [process {tag}] %(message)s"))
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
