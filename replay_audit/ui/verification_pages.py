"""The verification page, `GET /ui/verifications/{id}`: auditors and admins of the project
(another project's verification answers 404 like a missing one). The score of each group
against its benign null as a picture (`charts.null_chart`), the worst tokens per trace as text."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from replay_audit.api.deps import DBSession
from replay_audit.ui.charts import null_chart
from replay_audit.ui.pages import Viewer, _page
from replay_audit.verifications import service

router = APIRouter(include_in_schema=False)


def _chart(report: dict[str, Any]) -> Any:
    rows = [
        (g["group"], g["null_quantiles"] or [], g["threshold"], g["score"])
        for g in report["groups"]
    ]
    return null_chart(rows) if rows else None


@router.get("/verifications/{verification_id}")
def verification_page(
    request: Request, verification_id: str, principal: Viewer, session: DBSession
) -> Response:
    v = service.get_verification(session, principal.project_id, verification_id)
    report = v.report
    chart = _chart(report) if report is not None else None
    return _page(request, "ui/verification.html", verification=v, report=report, chart=chart)
