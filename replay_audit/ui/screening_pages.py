"""The screening report page, `GET /ui/screenings/{id}`: auditors and admins of the project
(another project's screening answers 404 like a missing one)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from replay_audit.api.deps import DBSession
from replay_audit.screenings import service
from replay_audit.ui.pages import Viewer, _page
from replay_audit.ui.screening_view import context

router = APIRouter(include_in_schema=False)


@router.get("/screenings/{screening_id}")
def screening_page(
    request: Request, screening_id: str, principal: Viewer, session: DBSession
) -> Response:
    screening = service.get_screening(session, principal.project_id, screening_id)
    report = service.report_of(screening)
    extra = context(report) if report is not None else {"report": None}
    return _page(request, "ui/screening.html", screening=screening, **extra)
