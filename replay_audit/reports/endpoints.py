"""HTTP: a run's report and its export, under `/v1/replays/{id}`. Thin handlers."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from replay_audit.api.deps import DBSession, Reader
from replay_audit.db.ids import cursor_pattern
from replay_audit.formats import BodyDType
from replay_audit.input import UtcDatetime
from replay_audit.replays.models import ReplayRun
from replay_audit.reports import browsing, export, statistics
from replay_audit.reports.export import ExportFormat
from replay_audit.reports.filters import RunFilter
from replay_audit.reports.schemas import RunList, RunReport
from replay_audit.stats.report import DEFAULT_LIST_LIMIT, DEFAULT_TOST_ALPHA, DEFAULT_TOST_MARGIN

router = APIRouter(prefix="/v1/replays", tags=["reports"])

# The report lists fixed/broke trace ids, the export replayed tokens and texts: result readers
# only (`Reader`; a submitter key polls a run's status, `GET /v1/replays/{id}`, and no more).

#: Largest page of `GET /v1/replays`.
MAX_RUNS_PAGE = 200


@router.get("", response_model=RunList, summary="List replay runs, newest first, paginated")
def list_runs(
    session: DBSession,
    principal: Reader,
    name: Annotated[
        str | None, Query(max_length=200, description="the run's name contains this text")
    ] = None,
    model: Annotated[
        str | None, Query(description="some trace of the run has this model.name")
    ] = None,
    dtype: Annotated[
        BodyDType | None, Query(description="some target of the run has this body dtype")
    ] = None,
    created_after: Annotated[UtcDatetime | None, Query(description="created at or after")] = None,
    created_before: Annotated[UtcDatetime | None, Query(description="created before")] = None,
    cursor: Annotated[
        str | None,
        Query(pattern=cursor_pattern("run"), description="`next_cursor` of the previous page"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_RUNS_PAGE)] = 50,
) -> RunList:
    """The project's runs with their names, status, models and target labels."""
    f = RunFilter(
        name=name,
        model_name=model,
        dtype=dtype,
        created_after=created_after,
        created_before=created_before,
    )
    return browsing.run_list(session, principal.project_id, f, cursor=cursor, limit=limit)


@router.get("/{run_id}/report", response_model=RunReport)
def read_report(
    run_id: str,
    session: DBSession,
    principal: Reader,
    a: Annotated[
        int | None, Query(ge=0, description="baseline comparison of the pair (0 if only `b`)")
    ] = None,
    b: Annotated[
        int | None, Query(ge=0, description="treated comparison of the pair (0 if only `a`)")
    ] = None,
    margin: Annotated[float, Query(ge=0, lt=1, description="TOST margin")] = (DEFAULT_TOST_MARGIN),
    alpha: Annotated[float, Query(gt=0, lt=0.5)] = DEFAULT_TOST_ALPHA,
    list_limit: Annotated[int, Query(ge=0, le=1000)] = DEFAULT_LIST_LIMIT,
) -> RunReport:
    """Statistics of a run with their intervals: per comparison, lifts over comparison 0 and
    of the pair (a, b), task accuracy where traces carry reference answers. One of a and b
    alone pairs it with comparison 0, the baseline of every lift."""
    run = browsing.get_run(session, principal.project_id, run_id)
    pair = None if a is None and b is None else (a or 0, b or 0)
    return statistics.run_report(
        session, run, pair=pair, margin=margin, alpha=alpha, list_limit=list_limit
    )


@router.get(
    "/{run_id}/export",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/csv": {}, "application/x-ndjson": {}},
            "description": "One row per trace x comparison (CSV header first)",
        }
    },
)
def export_results(
    run_id: str,
    request: Request,
    session: DBSession,
    principal: Reader,
    format: Annotated[ExportFormat, Query()] = "csv",
) -> StreamingResponse:
    """Every result of the run, streamed as CSV or JSONL."""
    run = browsing.get_run(session, principal.project_id, run_id)
    return export_response(request, run, format)


def export_response(request: Request, run: ReplayRun, fmt: ExportFormat) -> StreamingResponse:
    """The streamed export of `run` (already authorised) in `fmt` (shared with the UI)."""
    return StreamingResponse(
        export.stream(request.app.state.sessionmaker, run, fmt),
        media_type=export.MEDIA_TYPES[fmt],
        headers={
            "Content-Disposition": f'attachment; filename="{export.filename(run, fmt)}"',
            "Cache-Control": "no-store",
        },
    )
