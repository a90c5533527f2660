"""All SQL of the reports domain: the runs list, pairs of comparisons joined by trace (the
flips pages), and pages of result rows fetched by keyset (lists, export). A run's figures are
read by `replays.repository.result_figures` for the one statistics builder.

Never commits (reports only read). Booleans are compared with SQLAlchemy's `true()`/`false()`,
so the same statement runs on SQLite (0/1 integers) and PostgreSQL (booleans).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import (
    ColumnElement,
    and_,
    case,
    exists,
    false,
    func,
    select,
    text,
    true,
)
from sqlalchemy.orm import Session

from replay_audit.replays.models import ReplayResult, ReplayRun
from replay_audit.replays.repository import exact_of, pair_join
from replay_audit.reports.filters import ResultFilter, RunFilter
from replay_audit.traces.models import NumericalConfigRow, Trace

R = ReplayResult


def _ok() -> ColumnElement[bool]:
    return R.status == "ok"


def _exact() -> ColumnElement[bool]:
    return func.coalesce(R.exact_match, false()) == true()


def _diverged() -> ColumnElement[bool]:
    # As the stored aggregate counts them: an ok row whose replay did not match (a trace a
    # scan-then-decode run only scanned, exact_match NULL, is neither exact nor diverged).
    return and_(_ok(), R.exact_match == false())


# -- runs ------------------------------------------------------------------------------------


def _target_dtype_clause(session: Session, dtype: str) -> ColumnElement[bool]:
    # Any element of the run's `targets` JSON array with this dtype; JSON array functions
    # differ between the two databases.
    if session.get_bind().dialect.name == "postgresql":
        clause = text(
            "EXISTS (SELECT 1 FROM json_array_elements(replay_runs.targets) AS t(value) "
            "WHERE t.value ->> 'dtype' = :target_dtype)"
        )
    else:
        clause = text(
            "EXISTS (SELECT 1 FROM json_each(replay_runs.targets) AS t "
            "WHERE json_extract(t.value, '$.dtype') = :target_dtype)"
        )
    return clause.bindparams(target_dtype=dtype)  # type: ignore[return-value]


def list_runs(
    session: Session, project_id: int, f: RunFilter, *, before_id: int | None, limit: int
) -> list[ReplayRun]:
    """The project's runs, newest first, `limit` of them with ids below `before_id`."""
    stmt = select(ReplayRun).where(ReplayRun.project_id == project_id)
    if f.name is not None:
        # A substring, not a pattern: the user's % and _ are literal.
        literal = f.name.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        stmt = stmt.where(ReplayRun.name.ilike(f"%{literal}%", escape="\\"))
    if f.created_after is not None:
        stmt = stmt.where(ReplayRun.created_at >= f.created_after)
    if f.created_before is not None:
        stmt = stmt.where(ReplayRun.created_at < f.created_before)
    if f.dtype is not None:
        stmt = stmt.where(_target_dtype_clause(session, f.dtype))
    if f.model_name is not None:
        stmt = stmt.where(
            exists(
                select(1)
                .select_from(R)
                .join(Trace, Trace.id == R.trace_id)
                .where(R.run_id == ReplayRun.id, Trace.model_name == f.model_name)
            )
        )
    if before_id is not None:
        stmt = stmt.where(ReplayRun.id < before_id)
    return list(session.scalars(stmt.order_by(ReplayRun.id.desc()).limit(limit)))


def run_models(session: Session, run_ids: Sequence[int]) -> dict[int, list[str]]:
    """The distinct model names of each run's traces (from its results)."""
    if not run_ids:
        return {}
    stmt = (
        select(R.run_id, Trace.model_name)
        .join(Trace, Trace.id == R.trace_id)
        .where(R.run_id.in_(run_ids), R.comparison == 0)
        .distinct()
    )
    out: dict[int, list[str]] = {}
    for run_id, name in session.execute(stmt):
        out.setdefault(int(run_id), []).append(str(name))
    return {k: sorted(v) for k, v in out.items()}


def project_model_names(session: Session, project_id: int) -> list[str]:
    """Model names of the project's traces (the runs list's model filter choices)."""
    stmt = select(Trace.model_name).where(Trace.project_id == project_id).distinct()
    return sorted(str(n) for n in session.scalars(stmt))


# -- pairs of comparisons ---------------------------------------------------------------------


@dataclass(frozen=True)
class FlipRow:
    trace_id: int
    trace_public_id: str
    external_id: str | None


def flipped_traces(
    session: Session,
    run_a: int,
    comparison_a: int,
    run_b: int,
    comparison_b: int,
    *,
    fixed: bool,
    after_trace_id: int | None,
    limit: int,
) -> list[FlipRow]:
    """Traces exact in b but not in a (`fixed`), or exact in a but not in b, by trace id."""
    a, b, base = pair_join(run_a, comparison_a, run_b, comparison_b)
    ea, eb = exact_of(a), exact_of(b)
    stmt = (
        base.add_columns(Trace.id, Trace.public_id, Trace.external_id)
        .join(Trace, Trace.id == a.trace_id)
        .where(and_(eb, ~ea) if fixed else and_(ea, ~eb))
        .order_by(Trace.id)
        .limit(limit)
    )
    if after_trace_id is not None:
        stmt = stmt.where(Trace.id > after_trace_id)
    return [FlipRow(int(i), str(p), e) for i, p, e in session.execute(stmt)]


# -- result rows -------------------------------------------------------------------------------


class ResultSummary(NamedTuple):
    """A result's summary columns (no token arrays, no detail JSON): what lists show, and its
    trace's ids and tags where the list shows them. Fields in `_SUMMARY_COLUMNS`' order."""

    id: int
    comparison: int
    status: str
    error: str | None
    exact_match: bool | None
    first_divergence_step: int | None
    category: str | None
    margin_a: float | None
    margin_a_ulps: float | None
    margin_b: float | None
    margin_b_ulps: float | None
    length_difference: int | None
    gate_triggers: int | None
    n_steps: int | None
    gate_triggers_a: int | None
    n_steps_a: int | None
    screen: str | None
    #: Decoded only to t* + the run's decode window (a prefix: no length difference).
    window_cut: bool | None
    #: What it was judged against (`formats.Baseline`; None: "logged", rows of earlier ones).
    baseline: str | None
    public_id: str | None = None
    external_id: str | None = None
    tags: list[str] | None = None


#: The columns of `ResultSummary`, but the trace's (its last three fields).
_SUMMARY_COLUMNS = tuple(getattr(R, f) for f in ResultSummary._fields[:-3])


def results_page(
    session: Session, run_id: int, f: ResultFilter, *, after_id: int | None, limit: int
) -> list[ResultSummary]:
    """Summary rows of a run's results with their trace's ids and tags, in result id order."""
    stmt = (
        select(*_SUMMARY_COLUMNS, Trace.public_id, Trace.external_id, Trace.tags)
        .join(Trace, Trace.id == R.trace_id)
        .where(R.run_id == run_id)
        .order_by(R.id)
        .limit(limit)
    )
    if f.comparison is not None:
        stmt = stmt.where(R.comparison == f.comparison)
    if f.category is not None:
        stmt = stmt.where(R.category == f.category, _ok())
    if f.outcome == "exact":
        stmt = stmt.where(_ok(), _exact())
    elif f.outcome == "diverged":
        stmt = stmt.where(_diverged())
    elif f.outcome == "failed":
        stmt = stmt.where(R.status == "failed")
    if after_id is not None:
        stmt = stmt.where(R.id > after_id)
    return [ResultSummary._make(row) for row in session.execute(stmt)]


def get_trace(session: Session, project_id: int, public_id: str) -> Trace | None:
    return session.scalar(
        select(Trace).where(Trace.project_id == project_id, Trace.public_id == public_id)
    )


def trace_results(session: Session, run_id: int, trace_id: int) -> list[ReplayResult]:
    """Every result of one trace in one run, by comparison."""
    stmt = (
        select(ReplayResult)
        .where(R.run_id == run_id, R.trace_id == trace_id)
        .order_by(R.comparison)
    )
    return list(session.scalars(stmt))


def neighbour_traces(
    session: Session, run_id: int, trace_id: int, comparison: int
) -> tuple[str | None, str | None]:
    """Public ids of the previous and next diverged trace of the comparison (for paging
    through divergences on the trace page)."""

    def one(before: bool) -> str | None:
        stmt = (
            select(Trace.public_id)
            .join(R, R.trace_id == Trace.id)
            .where(R.run_id == run_id, R.comparison == comparison, _diverged())
            .where(R.trace_id < trace_id if before else R.trace_id > trace_id)
            .order_by(R.trace_id.desc() if before else R.trace_id)
            .limit(1)
        )
        found = session.scalar(stmt)
        return str(found) if found is not None else None

    return one(True), one(False)


# -- export ------------------------------------------------------------------------------------


def export_batch(
    session: Session, run_id: int, *, after_id: int, full: bool, limit: int
) -> list[dict[str, Any]]:
    """Up to `limit` results of a run with result id above `after_id`, in id order (keyset: one
    indexed range scan per batch), with their trace's ids, model, tags and configuration
    (`config_id`, `config_json`). `full` adds the detail JSON and the replayed token arrays."""
    columns: list[Any] = [
        *_SUMMARY_COLUMNS,
        R.margin_a_source,
        R.trigger_rate,
        R.mean_gap,
        R.tie,
        R.cascade_length,
        R.answer_extractor,
        R.answer_a,
        R.answer_b,
        R.created_at,
        Trace.public_id,
        Trace.external_id,
        Trace.model_name,
        Trace.tags,
        Trace.reference_answer.is_not(None).label("has_reference_answer"),
        # The trace's configuration, which says where its token ids come from (a few per run).
        Trace.config_id,
        NumericalConfigRow.config_json,
    ]
    if full:
        # The columns `replays.results.result_json` reads (a row, not an entity: no ORM
        # bookkeeping per exported result).
        columns += [
            R.detail,
            R.output_a,
            R.output_b,
            R.resolved_a,
            R.resolved_b,
        ]
    stmt = (
        select(*columns)
        .join(Trace, Trace.id == R.trace_id)
        .join(NumericalConfigRow, NumericalConfigRow.id == Trace.config_id)
        .where(R.run_id == run_id, R.id > after_id)
        .order_by(R.id)
        .limit(limit)
    )
    rows = session.execute(stmt).all()
    out = [dict(r._mapping) for r in rows]
    if full:
        for d, r in zip(out, rows, strict=True):
            d["result"] = r
    return out


# -- one trace across runs ---------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayCounts:
    """How often a trace was replayed: results (trace x comparison), runs, diverged results."""

    results: int
    runs: int
    diverged: int


def replay_counts(session: Session, trace_ids: Sequence[int]) -> dict[int, ReplayCounts]:
    """Per trace (internal id), its results across every run; traces never replayed are absent.
    The traces are one project's, and so are the runs that replayed them."""
    if not trace_ids:
        return {}
    diverged = func.sum(case((_diverged(), 1), else_=0))
    stmt = (
        select(R.trace_id, func.count(), func.count(R.run_id.distinct()), diverged)
        .where(R.trace_id.in_(trace_ids))
        .group_by(R.trace_id)
    )
    return {
        int(t): ReplayCounts(int(n), int(runs), int(d or 0))
        for t, n, runs, d in session.execute(stmt)
    }


def trace_replays(
    session: Session, project_id: int, trace_id: int, *, before_id: int | None, limit: int
) -> list[tuple[ResultSummary, ReplayRun]]:
    """The results of one trace in every run of the project, newest first (by result id), with
    their run: summary columns only (no token arrays, no detail JSON)."""
    stmt = (
        select(*_SUMMARY_COLUMNS, ReplayRun)
        .join(ReplayRun, ReplayRun.id == R.run_id)
        .where(R.trace_id == trace_id, ReplayRun.project_id == project_id)
        .order_by(R.id.desc())
        .limit(limit)
    )
    if before_id is not None:
        stmt = stmt.where(R.id < before_id)
    # No trace columns: the trace is the one asked for.
    return [
        (ResultSummary._make([*row[:-1], None, None, None]), row.ReplayRun)
        for row in session.execute(stmt)
    ]


def internal_trace_ids(
    session: Session, project_id: int, public_ids: Sequence[str]
) -> dict[str, int]:
    """public id -> internal id of the project's traces among `public_ids`."""
    if not public_ids:
        return {}
    stmt = select(Trace.public_id, Trace.id).where(
        Trace.project_id == project_id, Trace.public_id.in_(public_ids)
    )
    return {str(p): int(i) for p, i in session.execute(stmt)}
