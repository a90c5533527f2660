"""A run's report: its statistics (`replays.statistics`, the one builder), the lift of any pair
of its comparisons, two runs against each other, task accuracy at any TOST margin, and pages of
the traces a lift fixed or broke.

Nothing here computes a figure of its own: the comparisons and the treatments' lifts are the
run's `RunStatistics` (stored when it finished), pairs and run-vs-run lifts go through the same
lift builder, accuracy at other parameters through the same accuracy builder.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from replay_audit.replays import statistics
from replay_audit.replays.models import ReplayRun
from replay_audit.replays.statistics import check_comparison, lift_between
from replay_audit.reports import repository
from replay_audit.reports.schemas import RunComparisonReport, RunReport
from replay_audit.stats.report import (
    DEFAULT_LIST_LIMIT,
    DEFAULT_TOST_ALPHA,
    DEFAULT_TOST_MARGIN,
    AccuracyReport,
    TraceRef,
)


def accuracy_report(
    session: Session,
    run: ReplayRun,
    *,
    margin: float = DEFAULT_TOST_MARGIN,
    alpha: float = DEFAULT_TOST_ALPHA,
) -> AccuracyReport | None:
    """The run's task accuracy (`stats.report.accuracy_report`) at TOST `margin` and level
    `alpha`; None when no trace of the run carries a reference answer. At the default
    parameters it is the run's stored statistics' accuracy."""
    if margin == DEFAULT_TOST_MARGIN and alpha == DEFAULT_TOST_ALPHA:
        return statistics.of_run(session, run).accuracy
    return statistics.accuracy(session, run, margin=margin, alpha=alpha)


def run_report(
    session: Session,
    run: ReplayRun,
    *,
    pair: tuple[int, int] | None = None,
    margin: float = DEFAULT_TOST_MARGIN,
    alpha: float = DEFAULT_TOST_ALPHA,
    list_limit: int = DEFAULT_LIST_LIMIT,
    with_accuracy: bool = True,
) -> RunReport:
    """Statistics of `run` (finished or not): each comparison, every treatment's lift over
    comparison 0, the lift of `pair` = (a, b) (b over a: one of those lifts when it is one, the
    run page's default), and, `with_accuracy`, task accuracy where the traces carry reference
    answers (`margin` and `alpha` checked by the caller, as the API's and the pages' queries do)."""
    stats = statistics.of_run(session, run)
    lifts = stats.lifts
    if list_limit != DEFAULT_LIST_LIMIT:
        lifts = [
            lift_between(session, run, lf.comparison_a, run, lf.comparison_b, list_limit=list_limit)
            for lf in lifts
        ]
    pair_lift = next((lf for lf in lifts if (lf.comparison_a, lf.comparison_b) == pair), None)
    if pair is not None and pair_lift is None:
        pair_lift = lift_between(session, run, pair[0], run, pair[1], list_limit=list_limit)
    return RunReport(
        run_id=run.public_id,
        status=run.status,
        partial=run.status not in ("done", "failed"),
        n_traces=run.n_traces,
        n_results=run.n_items,
        comparisons=stats.comparisons,
        lifts=lifts,
        pair=pair_lift,
        accuracy=accuracy_report(session, run, margin=margin, alpha=alpha)
        if with_accuracy
        else None,
        engine_reproduction=stats.engine_reproduction,
    )


def has_reference_answers(session: Session, run: ReplayRun) -> bool:
    """Whether some trace of the run carries a reference answer (cheap)."""
    return statistics.has_reference_answers(session, run)


def compare_runs(
    session: Session,
    run_a: ReplayRun,
    comparison_a: int,
    run_b: ReplayRun,
    comparison_b: int,
    *,
    list_limit: int = DEFAULT_LIST_LIMIT,
) -> RunComparisonReport:
    """Two runs of one project: each run's report, and comparison_b of run_b against
    comparison_a of run_a paired on the traces both replayed."""
    pair = lift_between(session, run_a, comparison_a, run_b, comparison_b, list_limit=list_limit)
    return RunComparisonReport(
        run_a=run_report(session, run_a, list_limit=list_limit, with_accuracy=False),
        run_b=run_report(session, run_b, list_limit=list_limit, with_accuracy=False),
        pair=pair,
        common_traces=pair.n,
    )


@dataclass(frozen=True)
class FlipsPage:
    items: list[TraceRef]
    next_after: int | None


def flips_page(
    session: Session,
    run_a: ReplayRun,
    comparison_a: int,
    run_b: ReplayRun,
    comparison_b: int,
    *,
    fixed: bool,
    after: int | None,
    limit: int,
) -> FlipsPage:
    """One page of the traces that (run_b, comparison_b) fixed (or broke) relative to
    (run_a, comparison_a); `next_after` is the cursor of the next page."""
    check_comparison(run_a, comparison_a, "a")
    check_comparison(run_b, comparison_b, "b")
    rows = repository.flipped_traces(
        session,
        run_a.id,
        comparison_a,
        run_b.id,
        comparison_b,
        fixed=fixed,
        after_trace_id=after,
        limit=limit + 1,
    )
    more = len(rows) > limit
    rows = rows[:limit]
    return FlipsPage(
        items=[TraceRef(id=r.trace_public_id, external_id=r.external_id) for r in rows],
        next_after=rows[-1].trace_id if more and rows else None,
    )
