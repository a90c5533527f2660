"""Browsing a project's runs and results: the runs list, pages of a run's results, one trace in
a run and its neighbours. Reads only; the figures shown come from the runs' statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from replay_audit.exceptions import NotFound
from replay_audit.replays import service as replays_service
from replay_audit.replays import statistics
from replay_audit.replays.models import ReplayResult, ReplayRun
from replay_audit.replays.statistics import check_comparison
from replay_audit.reports import repository
from replay_audit.reports.filters import ResultFilter, RunFilter
from replay_audit.stats.report import ProportionRead
from replay_audit.traces.models import Trace


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


@dataclass(frozen=True)
class ResultsPage:
    items: list[dict[str, Any]]
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
    return ResultsPage(items=rows, next_after=int(rows[-1]["id"]) if more and rows else None)


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
