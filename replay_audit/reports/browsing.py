"""Browsing a project's runs and results: the runs list, pages of a run's results, one trace in
a run and its neighbours; finding traces (the trace search) and one trace's results across every
run (its history). Reads only; the figures shown come from the runs' statistics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from sqlalchemy.orm import Session

from replay_audit.db.base import read_model
from replay_audit.exceptions import FieldError, NotFound
from replay_audit.replays import service as replays_service
from replay_audit.replays import statistics
from replay_audit.replays.domain import comparison_label
from replay_audit.replays.models import ReplayResult, ReplayRun
from replay_audit.replays.statistics import check_comparison
from replay_audit.reports import repository
from replay_audit.reports.filters import ResultFilter, RunFilter
from replay_audit.reports.repository import ReplayCounts, ResultSummary
from replay_audit.reports.schemas import RunList, RunSummaryRead
from replay_audit.stats.report import ProportionRead
from replay_audit.traces import service as traces_service
from replay_audit.traces.models import Trace
from replay_audit.traces.schemas import TraceSummary
from replay_audit.traces.selection import TraceSelection


def get_run(session: Session, project_id: int, public_id: str) -> ReplayRun:
    """The project's run `public_id`; NotFound for an unknown id or another project's run."""
    return replays_service.get_replay(session, project_id, public_id)


# -- lists -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSummary:
    run: ReplayRun
    models: list[str]
    targets: list[str]
    #: EAR of comparison 0 from the stored statistics (finished runs only).
    ear: ProportionRead | None


@dataclass(frozen=True)
class RunsPage:
    items: list[RunSummary]
    #: The `before` cursor of the next (older) page.
    next_before: int | None


def list_runs(
    session: Session, project_id: int, f: RunFilter, *, before: int | None, limit: int
) -> RunsPage:
    """The project's runs, newest first, filtered, one page."""
    runs = repository.list_runs(session, project_id, f, before_id=before, limit=limit + 1)
    more = len(runs) > limit
    runs = runs[:limit]
    models = repository.run_models(session, [r.id for r in runs])
    items = []
    for r in runs:
        stats = statistics.stored(r)
        items.append(
            RunSummary(
                run=r,
                models=models.get(r.id, []),
                targets=[t.display_label() for t in r.run_targets],
                ear=stats.comparisons[0].ear if stats and stats.comparisons else None,
            )
        )
    return RunsPage(items=items, next_before=runs[-1].id if more and runs else None)


#: The run list's cursor: `run` and the last run's row id (a pattern the OpenAPI document
#: states; 18 digits stay within a BIGINT).
RUN_CURSOR: Final = r"^run[0-9]{1,18}$"


def _encode_run_cursor(run_id: int) -> str:
    return f"run{run_id}"


def _decode_run_cursor(cursor: str) -> int:
    if not re.fullmatch(RUN_CURSOR, cursor):
        raise FieldError("malformed cursor", field="cursor")
    return int(cursor[3:])


def run_list(
    session: Session, project_id: int, f: RunFilter, *, cursor: str | None, limit: int
) -> RunList:
    """`GET /v1/replays`: one page of the project's runs, newest first, with `next_cursor`."""
    before = _decode_run_cursor(cursor) if cursor is not None else None
    page = list_runs(session, project_id, f, before=before, limit=limit)
    return RunList(
        items=[
            read_model(
                RunSummaryRead, s.run, id=s.run.public_id, models=s.models, targets=s.targets
            )
            for s in page.items
        ],
        next_cursor=_encode_run_cursor(page.next_before) if page.next_before else None,
    )


@dataclass(frozen=True)
class ResultsPage:
    items: list[ResultSummary]
    next_after: int | None


def results_page(
    session: Session, run: ReplayRun, f: ResultFilter, *, after: int | None, limit: int
) -> ResultsPage:
    """One page of a run's result rows (summary columns and the trace's ids and tags)."""
    if f.comparison is not None:
        check_comparison(run, f.comparison, "comparison")
    rows = repository.results_page(session, run.id, f, after_id=after, limit=limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    return ResultsPage(items=rows, next_after=rows[-1].id if more and rows else None)


def get_trace_in_run(
    session: Session, run: ReplayRun, trace_public_id: str
) -> tuple[Trace, list[ReplayResult]]:
    """The trace `trace_public_id` of the run's project and its results in the run; NotFound
    when the trace is another project's or the run has no result for it."""
    trace = repository.get_trace(session, run.project_id, trace_public_id)
    if trace is None:
        raise NotFound(f"no trace {trace_public_id!r}")
    results = repository.trace_results(session, run.id, trace.id)
    if not results:
        raise NotFound(f"run {run.public_id} has no result for trace {trace_public_id!r}")
    return trace, results


def engine_reproduced(session: Session, run: ReplayRun, trace: Trace) -> bool | None:
    """Whether this engine reproduced `trace` in its own logged configuration (None: the trace
    was logged by this project's engine, or the run has no engine check, or no result yet)."""
    return statistics.engine_reproduced(session, run, [trace.id]).get(trace.id)


def project_model_names(session: Session, project_id: int) -> list[str]:
    """The model names of the project's traces (the runs list's filter choices)."""
    return repository.project_model_names(session, project_id)


def neighbour_traces(
    session: Session, run: ReplayRun, trace: Trace, comparison: int
) -> tuple[str | None, str | None]:
    """The previous and next divergent trace of `comparison` (to page through divergences)."""
    return repository.neighbour_traces(session, run.id, trace.id, comparison)


# -- finding traces ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceHit:
    """One trace of a search, with how often it was replayed (None: never)."""

    trace: TraceSummary
    replays: ReplayCounts | None


@dataclass(frozen=True)
class TraceSearchPage:
    items: list[TraceHit]
    #: The `cursor` of the next (older) page, as `GET /v1/traces` gives it.
    next_cursor: str | None


def search_traces(
    session: Session,
    project_id: int,
    selection: TraceSelection,
    *,
    cursor: str | None,
    limit: int,
) -> TraceSearchPage:
    """One page of the project's traces in `selection`, newest first (the listing of
    `GET /v1/traces`, same cursor), each with its replay counts across runs."""
    page = traces_service.list_traces(session, project_id, selection, limit=limit, cursor=cursor)
    ids = repository.internal_trace_ids(session, project_id, [t.id for t in page.items])
    counts = repository.replay_counts(session, list(ids.values()))
    return TraceSearchPage(
        items=[TraceHit(t, counts.get(ids[t.id])) for t in page.items],
        next_cursor=page.next_cursor,
    )


@dataclass(frozen=True)
class TraceReplay:
    """One result of a trace in some run: the run, the comparison and its label, the summary
    columns of the result (`status`, `exact_match`, `first_divergence_step`, `category`,
    `margin_a`, `margin_b`, ...)."""

    run: ReplayRun
    comparison: int
    label: str
    result: ResultSummary


@dataclass(frozen=True)
class TraceHistory:
    trace: Trace
    replays: list[TraceReplay]
    #: The `before` cursor of the next (older) page of replays.
    next_before: int | None


def trace_history(
    session: Session, project_id: int, trace_public_id: str, *, before: int | None, limit: int
) -> TraceHistory:
    """The project's trace `trace_public_id` and one page of its results in every run, newest
    first; NotFound for an unknown id or another project's trace."""
    trace = repository.get_trace(session, project_id, trace_public_id)
    if trace is None:
        raise NotFound(f"no trace {trace_public_id!r}")
    rows = repository.trace_replays(
        session, project_id, trace.id, before_id=before, limit=limit + 1
    )
    more = len(rows) > limit
    rows = rows[:limit]
    replays = []
    for result, run in rows:
        index = result.comparison
        label = comparison_label(run.run_comparisons[index], run.run_targets)
        replays.append(TraceReplay(run=run, comparison=index, label=label, result=result))
    return TraceHistory(
        trace=trace,
        replays=replays,
        next_before=rows[-1][0].id if more and rows else None,
    )
