"""The web UI's trace pages: the trace search, and one trace across every run.

Auditors and admins only, like every page: a trace's texts and the list of a project's traces
are what an ingest key must not read.
"""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Final

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from replay_audit.api.deps import DBSession
from replay_audit.exceptions import FieldError
from replay_audit.reports import browsing
from replay_audit.traces.selection import TraceSelection
from replay_audit.ui.pages import MAX_ROW_ID, Viewer, _blank, _moment, _page

router = APIRouter(include_in_schema=False)

TRACES_PER_PAGE: Final = 50
REPLAYS_PER_PAGE: Final = 100
#: Longest value of a search field (a longer one cannot match: ids, tags and names are shorter).
MAX_FIELD: Final = 200


def _field(value: str | None, field: str) -> str | None:
    value = _blank(value)
    if value is not None and len(value) > MAX_FIELD:
        raise FieldError(f"{field}: at most {MAX_FIELD} characters", field=field)
    return value


@router.get("/traces")
def traces_search(
    request: Request,
    principal: Viewer,
    session: DBSession,
    id: str | None = None,
    external_id: str | None = None,
    tag: str | None = None,
    model: str | None = None,
    created_from: Annotated[str | None, Query(alias="from")] = None,
    created_to: Annotated[str | None, Query(alias="to")] = None,
    cursor: Annotated[str | None, Query(min_length=1)] = None,
) -> Response:
    filters = {
        "id": _field(id, "id"),
        "external_id": _field(external_id, "external_id"),
        "tag": _field(tag, "tag"),
        "model": _field(model, "model"),
        "from": _blank(created_from),
        "to": _blank(created_to),
    }
    selection = TraceSelection(
        public_id=filters["id"],
        external_id=filters["external_id"],
        tags=(filters["tag"],) if filters["tag"] else (),
        model_name=filters["model"],
        created_after=_moment(filters["from"], "from"),
        created_before=_moment(filters["to"], "to", end=True),
    )
    page = browsing.search_traces(
        session, principal.project_id, selection, cursor=cursor, limit=TRACES_PER_PAGE
    )
    given = {k: v for k, v in filters.items() if v}
    return _page(
        request,
        "ui/traces.html",
        page=page,
        filters={k: v or "" for k, v in filters.items()},
        searched=bool(given),
        models=browsing.project_model_names(session, principal.project_id),
        next_query=urllib.parse.urlencode(given | {"cursor": page.next_cursor})
        if page.next_cursor
        else None,
        first_query=urllib.parse.urlencode(given) if cursor else None,
    )


@router.get("/traces/{trace_id}")
def trace_history_page(
    request: Request,
    trace_id: str,
    principal: Viewer,
    session: DBSession,
    before: Annotated[int | None, Query(ge=1, le=MAX_ROW_ID)] = None,
) -> Response:
    history = browsing.trace_history(
        session, principal.project_id, trace_id, before=before, limit=REPLAYS_PER_PAGE
    )
    return _page(
        request,
        "ui/trace_history.html",
        trace=history.trace,
        config=history.trace.config,
        replays=history.replays,
        runs=len({r.run.id for r in history.replays}),
        next_query=urllib.parse.urlencode({"before": history.next_before})
        if history.next_before
        else None,
        first_page=before is None,
    )
