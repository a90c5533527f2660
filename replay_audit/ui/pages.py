"""The web UI's sign-in and run pages (under /ui). Thin handlers: check the session, call one
report service function, render a template."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Annotated, Any, Final, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from markupsafe import Markup

from replay_audit.api.deps import DBSession
from replay_audit.auth.schemas import Principal
from replay_audit.config import Settings
from replay_audit.exceptions import BadRequest, FieldError, NotAuthenticated, PermissionDenied
from replay_audit.formats import BODY_DTYPES, CATEGORIES
from replay_audit.replays.domain import (
    c_against_logged,
    comparison_label,
    is_treatment,
    logging_engine,
)
from replay_audit.replays.models import ReplayRun
from replay_audit.replays.service import pending_reason, ran, results_per_s
from replay_audit.reports import browsing, statistics
from replay_audit.reports.endpoints import export_response
from replay_audit.reports.filters import ResultFilter, RunFilter
from replay_audit.reports.schemas import RunReport
from replay_audit.screenings import service as screenings_service
from replay_audit.stats.report import DEFAULT_TOST_MARGIN
from replay_audit.ui import session as ui_session
from replay_audit.ui import trace_view
from replay_audit.ui.charts import (
    category_chart,
    histogram_chart,
    lift_chart,
    margin_at_divergence_chart,
)
from replay_audit.ui.templating import render
from replay_audit.verifications import service as verifications_service

router = APIRouter(include_in_schema=False)

RUNS_PER_PAGE: Final = 25
#: Largest row id (a BIGINT): a larger `before`/`after` cursor is a 422, never a database error.
MAX_ROW_ID: Final = 2**63 - 1
RESULTS_PER_PAGE: Final = 50
FLIPS_PER_PAGE: Final = 200
#: Largest sign-in form body read (a key is ~60 characters).
MAX_FORM_BYTES: Final = 8192


class SignInRequired(NotAuthenticated):
    """No valid session: the UI answers with a redirect to the sign-in page."""


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _secret(request: Request) -> bytes:
    return ui_session.session_secret(_settings(request))


def current_session(request: Request) -> ui_session.UiSession | None:
    return ui_session.verify(_secret(request), request.cookies.get(ui_session.COOKIE_NAME))


def signed_in_session(request: Request) -> ui_session.UiSession:
    """The verified session cookie; SignInRequired without one. Needs no database, so a browser
    without a session is sent to sign in even while the database is down."""
    s = current_session(request)
    if s is None:
        raise SignInRequired("sign in to browse reports")
    return s


def ui_principal(
    request: Request,
    s: Annotated[ui_session.UiSession, Depends(signed_in_session)],
    session: DBSession,
) -> Principal:
    """The signed-in caller (auditor or admin); SignInRequired without a valid session."""
    try:
        principal = ui_session.principal_for(session, s)
    except NotAuthenticated as e:
        raise SignInRequired(e.message) from None
    request.state.ui_session = s
    request.state.principal = principal
    return principal


Viewer = Annotated[Principal, Depends(ui_principal)]


def _page(request: Request, template: str, status_code: int = 200, **context: Any) -> Response:
    """Render a page of a signed-in user (the header's sign-out form needs the CSRF token)."""
    s: ui_session.UiSession | None = getattr(request.state, "ui_session", None)
    context.setdefault("principal", getattr(request.state, "principal", None))
    context["csrf_token"] = s.csrf_token(_secret(request)) if s is not None else ""
    return render(request, template, context, status_code)


def _base(request: Request) -> str:
    return str(request.scope.get("root_path", ""))


def _cookie_scope(request: Request) -> dict[str, Any]:
    """Every UI cookie's attributes: the UI's path, no script access, same-site, and secure
    where the request came over HTTPS."""
    secure = request.url.scheme == "https"
    return {"path": _base(request) or "/", "httponly": True, "samesite": "lax", "secure": secure}


def _safe_next(request: Request, target: str | None) -> str:
    """Where to go after signing in: only a path of this UI (never another site)."""
    base = _base(request)
    if (
        target
        and target.startswith(base + "/")
        and not target.startswith("//")
        and "\\" not in target
        and not urllib.parse.urlsplit(target).netloc
    ):
        return target
    return f"{base}/runs"


async def form_fields(request: Request) -> dict[str, str]:
    """An urlencoded form body as a dict (first value of each field)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise BadRequest("form too large", field="body")
    parsed = urllib.parse.parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {k: v[0] for k, v in parsed.items()}


Form = Annotated[dict[str, str], Depends(form_fields)]


# -- sign-in -----------------------------------------------------------------------------------


@router.get("/")
def home(request: Request) -> Response:
    return RedirectResponse(f"{_base(request)}/runs", status_code=303)


def _sign_in_page(
    request: Request, next_url: str, error: str | None = None, status_code: int = 200
) -> Response:
    token = ui_session.new_form_token()
    # Nobody is signed in here: `_page` renders no principal and no CSRF token.
    response = _page(
        request, "ui/sign_in.html", status_code, next=next_url, error=error, form_token=token
    )
    response.set_cookie(
        ui_session.SIGN_IN_COOKIE_NAME, token, max_age=3600, **_cookie_scope(request)
    )
    return response


@router.api_route("/sign-in", methods=["GET", "HEAD"])
def sign_in_form(request: Request, next: str | None = None) -> Response:
    return _sign_in_page(request, _safe_next(request, next))


@router.post("/sign-in")
def sign_in(request: Request, session: DBSession, form: Form) -> Response:
    """Check the key; on success set the session cookie and go where the user was going."""
    next_url = _safe_next(request, form.get("next"))
    if not ui_session.check_form_token(
        request.cookies.get(ui_session.SIGN_IN_COOKIE_NAME), form.get("form_token")
    ):
        return _sign_in_page(request, next_url, "The sign-in form expired; please try again.", 400)
    try:
        _, lookup = ui_session.sign_in(session, form.get("api_key"))
    except NotAuthenticated as e:
        return _sign_in_page(request, next_url, e.message, 401)
    except PermissionDenied as e:
        return _sign_in_page(request, next_url, e.message, 403)
    settings = _settings(request)
    response = RedirectResponse(next_url, status_code=303)
    response.set_cookie(
        ui_session.COOKIE_NAME,
        ui_session.issue(_secret(request), lookup, settings.session_max_age_s),
        max_age=settings.session_max_age_s,
        **_cookie_scope(request),
    )
    response.delete_cookie(ui_session.SIGN_IN_COOKIE_NAME, path=_base(request) or "/")
    return response


@router.post("/sign-out")
def sign_out(request: Request, form: Form) -> Response:
    s = current_session(request)
    if s is not None and not ui_session.check_csrf(_secret(request), s, form.get("csrf_token")):
        raise BadRequest("invalid sign-out form; reload the page and try again")
    response = RedirectResponse(f"{_base(request)}/sign-in", status_code=303)
    response.delete_cookie(ui_session.COOKIE_NAME, **_cookie_scope(request))
    return response


# -- runs ------------------------------------------------------------------------------------


def _moment(value: str | None, field: str, *, end: bool = False) -> datetime | None:
    """A date (the whole day, so `to` a day includes it) or a datetime-local input's time, in
    UTC; FieldError too past either end of the calendar once made UTC (`9999-12-31` as `to`)."""
    if not value:
        return None
    try:
        if len(value) == len("YYYY-MM-DD"):
            day = datetime.combine(date.fromisoformat(value), time.min, tzinfo=UTC)
            return day + timedelta(days=1) if end else day
        moment = datetime.fromisoformat(value)
        return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except (ValueError, OverflowError):
        raise FieldError(
            f"{field}: expected a date YYYY-MM-DD or a time YYYY-MM-DDTHH:MM between years 1 "
            f"and 9999, got {value!r}",
            field=field,
        ) from None


def _blank(value: str | None) -> str | None:
    return value.strip() or None if value is not None else None


@router.get("/runs")
def runs_list(
    request: Request,
    principal: Viewer,
    session: DBSession,
    model: str | None = None,
    dtype: str | None = None,
    created_from: Annotated[str | None, Query(alias="from")] = None,
    created_to: Annotated[str | None, Query(alias="to")] = None,
    before: Annotated[int | None, Query(ge=1, le=MAX_ROW_ID)] = None,
    name: Annotated[str | None, Query(max_length=200)] = None,
) -> Response:
    model, dtype, name = _blank(model), _blank(dtype), _blank(name)
    if dtype is not None and dtype not in BODY_DTYPES:
        raise FieldError(f"dtype must be one of {', '.join(BODY_DTYPES)}", field="dtype")
    f = RunFilter(
        model_name=model,
        name=name,
        dtype=dtype,
        created_after=_moment(created_from, "from"),
        created_before=_moment(created_to, "to", end=True),
    )
    page = browsing.list_runs(session, principal.project_id, f, before=before, limit=RUNS_PER_PAGE)
    filters = {
        "name": name or "",
        "model": model or "",
        "dtype": dtype or "",
        "from": created_from or "",
        "to": created_to or "",
    }
    next_query = None
    if page.next_before is not None:
        next_query = urllib.parse.urlencode(
            {k: v for k, v in filters.items() if v} | {"before": page.next_before}
        )
    return _page(
        request,
        "ui/runs.html",
        page=page,
        filters=filters,
        models=browsing.project_model_names(session, principal.project_id),
        dtypes=BODY_DTYPES,
        next_query=next_query,
        first_page=before is not None,
        screenings=screenings_service.recent_screenings(session, principal.project_id),
        verifications=verifications_service.recent_verifications(session, principal.project_id),
    )


@dataclass(frozen=True)
class ComparisonCharts:
    """A comparison's charts on the run page: categories, t*, margins at t* (both arms)."""

    categories: Markup
    t_star: Markup
    margin: Markup
    margin_ulps: Markup


def _comparison_labels(run: ReplayRun) -> list[str]:
    return [comparison_label(c, run.run_targets) for c in run.run_comparisons]


def _run_charts(report: RunReport) -> list[ComparisonCharts]:
    return [
        ComparisonCharts(
            categories=category_chart(c.categories),
            t_star=histogram_chart(c.t_star_histogram, "first divergence step t*"),
            margin=margin_at_divergence_chart(c.margin_at_divergence),
            margin_ulps=margin_at_divergence_chart(c.margin_at_divergence, ulps=True),
        )
        for c in report.comparisons
    ]


@router.get("/runs/{run_id}")
def run_page(
    request: Request,
    run_id: str,
    principal: Viewer,
    session: DBSession,
    a: Annotated[int | None, Query(ge=0)] = None,
    b: Annotated[int | None, Query(ge=0)] = None,
    comparison: Annotated[int | None, Query(ge=0)] = None,
    category: str | None = None,
    outcome: Literal["exact", "diverged", "failed", ""] = "",
    after: Annotated[int | None, Query(ge=0, le=MAX_ROW_ID)] = None,
) -> Response:
    run = browsing.get_run(session, principal.project_id, run_id)
    if a is None and b is None:
        # By default the first treatment against the baseline (never a self-replay).
        targets = run.run_targets
        first = next((c for c in run.run_comparisons if is_treatment(c, targets)), None)
        if first is not None:
            a, b = 0, first.index
    pair = (a, b) if a is not None and b is not None else None
    report = statistics.run_report(session, run, pair=pair, with_accuracy=False)
    category = _blank(category)
    if category is not None and category not in CATEGORIES:
        raise FieldError(f"category must be one of {', '.join(CATEGORIES)}", field="category")
    rf = ResultFilter(comparison=comparison, category=category, outcome=outcome or None)
    results = browsing.results_page(session, run, rf, after=after, limit=RESULTS_PER_PAGE)
    keep = dict(a=a, b=b, comparison=comparison, category=category, outcome=outcome or None)
    keep = {k: v for k, v in keep.items() if v is not None}
    next_query = (
        urllib.parse.urlencode(keep | {"after": results.next_after}) + "#results"
        if results.next_after is not None
        else None
    )
    return _page(
        request,
        "ui/run.html",
        run=run,
        report=report,
        charts=_run_charts(report),
        lift_chart=lift_chart(report.lifts) if report.lifts else None,
        pair_chart=lift_chart([report.pair]) if report.pair is not None else None,
        targets=[
            (i, t.display_label(), raw)
            for i, (t, raw) in enumerate(zip(run.run_targets, run.targets, strict=True))
        ],
        c_against_logged=[
            comparison_label(c, run.run_targets)
            for c in run.run_comparisons
            if c_against_logged(c, run.run_targets)
        ],
        ran=[
            (comparison_label(run.run_comparisons[r.comparison], run.run_targets), r)
            for r in ran(session, run)
        ],
        results=results,
        result_filter=rf,
        categories=CATEGORIES,
        next_query=next_query,
        first_query=urllib.parse.urlencode(keep) + "#results",
        pair=pair,
        has_reference_answers=statistics.has_reference_answers(session, run),
        results_per_s=results_per_s(run, sum(c.n for c in report.comparisons)),
        screened=[c for c in report.comparisons if c.screening is not None],
        pending_reason=pending_reason(session, run, request.app.state.queue),
    )


@router.get("/runs/{run_id}/accuracy")
def accuracy_page(
    request: Request,
    run_id: str,
    principal: Viewer,
    session: DBSession,
    margin: Annotated[float, Query(ge=0, lt=1)] = DEFAULT_TOST_MARGIN,
) -> Response:
    """Task accuracy per arm, correctness flips and non-inferiority at `margin`."""
    run = browsing.get_run(session, principal.project_id, run_id)
    return _page(
        request,
        "ui/accuracy.html",
        run=run,
        accuracy=statistics.accuracy_report(session, run, margin=margin),
    )


@router.get("/runs/{run_id}/flips")
def flips(
    request: Request,
    run_id: str,
    principal: Viewer,
    session: DBSession,
    a: Annotated[int, Query(ge=0)],
    b: Annotated[int, Query(ge=0)],
    kind: Literal["fixed", "broke"] = "fixed",
    other: str | None = None,
    after: Annotated[int | None, Query(ge=0, le=MAX_ROW_ID)] = None,
) -> Response:
    """The traces comparison b fixed (or broke) relative to comparison a; with `other`, b is a
    comparison of that run (the two-run comparison's lists)."""
    run_a = browsing.get_run(session, principal.project_id, run_id)
    run_b = browsing.get_run(session, principal.project_id, other) if other else run_a
    page = statistics.flips_page(
        session, run_a, a, run_b, b, fixed=kind == "fixed", after=after, limit=FLIPS_PER_PAGE
    )
    query = {"a": a, "b": b, "kind": kind} | ({"other": other} if other else {})
    return _page(
        request,
        "ui/flips.html",
        run_a=run_a,
        run_b=run_b,
        a=a,
        b=b,
        kind=kind,
        label_a=_comparison_labels(run_a)[a],
        label_b=_comparison_labels(run_b)[b],
        page=page,
        next_query=urllib.parse.urlencode(query | {"after": page.next_after})
        if page.next_after is not None
        else None,
    )


@router.get("/runs/{run_id}/export.{fmt}")
def export(
    request: Request,
    run_id: str,
    fmt: Literal["csv", "jsonl"],
    principal: Viewer,
    session: DBSession,
) -> StreamingResponse:
    run = browsing.get_run(session, principal.project_id, run_id)
    return export_response(request, run, fmt)


@router.get("/runs/{run_id}/traces/{trace_id}")
def trace_page(
    request: Request,
    run_id: str,
    trace_id: str,
    principal: Viewer,
    session: DBSession,
    comparison: Annotated[int | None, Query(ge=0)] = None,
) -> Response:
    run = browsing.get_run(session, principal.project_id, run_id)
    trace, results = browsing.get_trace_in_run(session, run, trace_id)
    by_comparison = {r.comparison: r for r in results}
    if comparison is None:
        diverged = [r.comparison for r in results if r.status == "ok" and r.exact_match is False]
        comparison = diverged[0] if diverged else results[0].comparison
    if comparison not in by_comparison:
        raise FieldError(
            f"comparison: trace {trace_id} has results for comparisons "
            f"{', '.join(str(c) for c in sorted(by_comparison))}",
            field="comparison",
        )
    view = trace_view.build(
        run,
        trace,
        by_comparison[comparison],
        engine_reproduced=browsing.engine_reproduced(session, run, trace),
    )
    previous, following = browsing.neighbour_traces(session, run, trace, comparison)
    return _page(
        request,
        "ui/trace.html",
        run=run,
        trace=trace,
        results=results,
        labels=_comparison_labels(run),  # by comparison index
        view=view,
        trace_engine=logging_engine(trace.config.config_json),
        previous=previous,
        following=following,
    )


@router.get("/compare")
def compare(
    request: Request,
    principal: Viewer,
    session: DBSession,
    run: Annotated[list[str] | None, Query()] = None,
    ca: Annotated[int, Query(ge=0)] = 0,
    cb: Annotated[int, Query(ge=0)] = 0,
) -> Response:
    """Two runs: pick them on the runs list (two check boxes) or pass ?run=A&run=B. The first
    is the baseline (comparison `ca`), the second the treated run (`cb`); the page links to
    the same comparison with the two exchanged."""
    ids = [r for r in run or [] if r]
    if len(ids) != 2:
        raise FieldError("choose exactly two runs to compare", field="run")
    run_a = browsing.get_run(session, principal.project_id, ids[0])
    run_b = browsing.get_run(session, principal.project_id, ids[1])
    report = statistics.compare_runs(session, run_a, ca, run_b, cb)
    return _page(
        request,
        "ui/compare.html",
        run_a=run_a,
        run_b=run_b,
        ca=ca,
        cb=cb,
        report=report,
        comparisons_a=list(enumerate(_comparison_labels(run_a))),
        comparisons_b=list(enumerate(_comparison_labels(run_b))),
        pair_chart=lift_chart([report.pair]),
        # The same two runs and comparisons with the baseline and the treated run exchanged.
        swap_query=urllib.parse.urlencode(
            {"run": [run_b.public_id, run_a.public_id], "ca": cb, "cb": ca}, doseq=True
        ),
    )
