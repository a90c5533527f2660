"""The web UI's audit schedule pages (thin: the audits service computes, the templates show).
Read-only: schedules are created and changed through the API (admin) or the CLI."""

from __future__ import annotations

from typing import Annotated, Final

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from replay_audit.api.deps import DBSession
from replay_audit.audits import service
from replay_audit.ui.pages import Viewer, _page, _settings
from replay_audit.ui.trend_chart import category_mix_chart, trend_chart

router = APIRouter(include_in_schema=False)

#: Runs on the schedule page (the chart and the table).
TREND_RUNS: Final = 60
ALERTS_SHOWN: Final = 20


@router.get("/schedules")
def schedules_list(request: Request, principal: Viewer, session: DBSession) -> Response:
    schedules = service.list_schedules(session, principal.project_id)
    return _page(
        request,
        "ui/schedules.html",
        schedules=service.to_reads(session, schedules, reveal_webhook=False),
    )


@router.get("/schedules/{schedule_id}")
def schedule_page(
    request: Request,
    schedule_id: str,
    principal: Viewer,
    session: DBSession,
    runs: Annotated[int, Query(ge=1, le=1000)] = TREND_RUNS,
) -> Response:
    schedule = service.get_schedule(session, principal.project_id, schedule_id)
    [read] = service.to_reads(session, [schedule], reveal_webhook=False)
    trend = service.trend(session, schedule, limit=runs)
    missed = service.missed(session, schedule)
    alerts = service.alerts(session, schedule, limit=ALERTS_SHOWN, reveal_url=False)
    return _page(
        request,
        "ui/schedule.html",
        schedule=read,
        targets=[t.to_domain().display_label() for t in read.replay.targets]
        + (["self (logged configuration)"] if read.replay.compare_with == "self" else []),
        points=trend.points,
        newest_first=list(reversed(trend.points)),
        trend_chart=trend_chart(trend.points),
        mix_chart=category_mix_chart(trend.points),
        missed=missed,
        alerts=alerts,
        drift_alpha=_settings(request).drift_alpha,
        drift_min_n=_settings(request).drift_min_n,
    )
