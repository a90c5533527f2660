"""All SQL of the replays domain. Never commits: the edge (request, job, CLI) does."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Final, TypeVar

import numpy as np
import orjson
from sqlalchemy import Text, and_, cast, false, func, or_, select, true, update
from sqlalchemy.orm import Session, aliased
from sqlalchemy.sql.expression import ColumnElement, Select

from replay_audit.db import jobs
from replay_audit.db.base import utcnow
from replay_audit.db.engine import dialect_insert
from replay_audit.replays.domain import LoggedPlacement, LoggedTrace, logging_engine
from replay_audit.replays.models import ReplayJob, ReplayResult, ReplayRun
from replay_audit.replays.results import FIGURE_COLUMNS, ResultRow, figures, token_ids_source
from replay_audit.stats.report import AnswerFigures, PairedOutcome, ResultFigures, TraceRef
from replay_audit.traces.models import NumericalConfigRow, Trace

R = ReplayResult


def logged_trace(trace: Trace) -> LoggedTrace:
    """What a replay needs of a stored trace (arrays straight from the packed columns)."""
    logits = None
    if trace.top_k and trace.top_k_logits is not None:
        logits = np.asarray(trace.top_k_logits, np.float32).reshape(-1, trace.top_k)
    return LoggedTrace.from_parts(
        external_id=trace.external_id,
        weights_sha256=trace.weights_sha256,
        vocab_size=trace.vocab_size,
        config=orjson.loads(trace.config.config_json),
        decoding=trace.decoding,
        prompt_token_ids=trace.prompt_token_ids,
        output_token_ids=trace.output_token_ids,
        top_k_logits=logits,
        output_text=trace.output_text,
        reference_answer=trace.reference_answer,
        output_token_pieces=trace.output_token_pieces,
    )


get_run = partial(jobs.get_by_public_id, ReplayRun)
get_run_by_idempotency_key = partial(jobs.get_by_idempotency_key, ReplayRun)


def add_jobs(
    session: Session, run: ReplayRun, chunks: Sequence[tuple[str, list[int]]]
) -> list[int]:
    """Insert one job of the run per (queue, trace ids) chunk; the job ids, in chunk order."""
    rows = [
        ReplayJob(run_id=run.id, chunk=i, queue=queue, trace_ids=ids)
        for i, (queue, ids) in enumerate(chunks)
    ]
    session.add_all(rows)
    session.flush()
    return [j.id for j in rows]


def progress(session: Session, run: ReplayRun) -> tuple[int, int]:
    """(ok results, failed results) of a run."""
    rows = session.execute(
        select(ReplayResult.status, func.count())
        .where(ReplayResult.run_id == run.id)
        .group_by(ReplayResult.status)
    ).all()
    counts = {status: int(n) for status, n in rows}
    return counts.get("ok", 0), counts.get("failed", 0)


def missing_comparisons_of(
    session: Session, run_id: int, trace_ids: Sequence[int], n_comparisons: int
) -> dict[int, list[int]]:
    """The comparisons of each trace that have no result yet, in one query: trace id ->
    comparisons to do."""
    have: dict[int, set[int]] = {t: set() for t in trace_ids}
    if trace_ids:
        found = session.execute(
            select(ReplayResult.trace_id, ReplayResult.comparison).where(
                ReplayResult.run_id == run_id, ReplayResult.trace_id.in_(list(trace_ids))
            )
        )
        for trace_id, comparison in found:
            have[trace_id].add(comparison)
    return {t: [c for c in range(n_comparisons) if c not in have[t]] for t in trace_ids}


def traces_by_id(session: Session, trace_ids: Sequence[int]) -> dict[int, Trace]:
    """The traces of `trace_ids` that exist, in one query (their configuration joined)."""
    if not trace_ids:
        return {}
    return {t.id: t for t in session.scalars(select(Trace).where(Trace.id.in_(list(trace_ids))))}


def insert_results_of(
    session: Session, run_id: int, results: Sequence[tuple[int, Sequence[ResultRow]]]
) -> None:
    """Insert the results of many traces, (trace id, its rows) each, in two statements: one
    read of the traces' created_at (half of a result's key to its trace, and its partition on
    PostgreSQL), one insert of every row. A (run, trace, comparison) already there is left
    alone, and so is a trace that no longer exists (retention deleted it: no result may point
    at a deleted trace).

    The insert is Core's, on the table, every row with every column (a value a row lacks is
    NULL, as the ORM's bulk insert stored it by leaving the column out): the ORM's grouped
    its rows by which values were None, one statement a group (hundreds a window of 512)."""
    ids = [t for t, rows in results if rows]
    if not ids:
        return
    created = dict(
        session.execute(select(Trace.id, Trace.created_at).where(Trace.id.in_(ids))).all()
    )
    now = utcnow()
    values = [
        {
            **_NULLS,
            "run_id": run_id,
            "trace_id": trace_id,
            "trace_created_at": created[trace_id],
            "created_at": now,
            **r,
        }
        for trace_id, rows in results
        if trace_id in created  # a trace retention deleted gets no result
        for r in rows
    ]
    if values:
        stmt = dialect_insert(session)(_RESULTS).on_conflict_do_nothing(
            index_elements=["run_id", "trace_id", "trace_created_at", "comparison"]
        )
        session.execute(stmt, values)


#: The results table (Core: `insert_results_of`), and a row's columns a `ResultRow` may leave
#: out, each NULL.
_RESULTS: Final = ReplayResult.__table__
_NULLS: Final[dict[str, None]] = dict.fromkeys(sorted(ResultRow.__optional_keys__))


def insert_results(session: Session, run_id: int, trace_id: int, rows: Sequence[ResultRow]) -> None:
    """Insert one trace's results (`insert_results_of`)."""
    insert_results_of(session, run_id, [(trace_id, rows)])


def lock_run(session: Session, run_id: int) -> ReplayRun:
    """The run row, reloaded and locked for the rest of the transaction (PostgreSQL `FOR NO
    KEY UPDATE`: two lockers take turns, but neither waits for a window of results being
    written, whose foreign key holds `FOR KEY SHARE` on the row until it commits, as `FOR
    UPDATE` did; SQLite write transactions are serialised by `BEGIN IMMEDIATE`)."""
    stmt = select(ReplayRun).where(ReplayRun.id == run_id)
    if session.get_bind().dialect.name == "postgresql":
        stmt = stmt.with_for_update(key_share=True)
    run = session.scalar(stmt.execution_options(populate_existing=True))
    assert run is not None
    return run


def count_unfinished_jobs(session: Session, run_id: int) -> int:
    """How many jobs of the run are not done."""
    stmt = select(func.count()).where(ReplayJob.run_id == run_id, ReplayJob.status != "done")
    return int(session.scalar(stmt) or 0)


def release_job(session: Session, job_id: int) -> None:
    """A job stopped between two traces because its runner is stopping: queued again, and the
    attempt not counted (a Ctrl-C is not a crash; MAX_JOB_ATTEMPTS counts crashes)."""
    job = session.get(ReplayJob, job_id)
    if job is None or job.status != "running":
        return
    job.status, job.attempts, job.updated_at = "queued", max(0, job.attempts - 1), utcnow()


def finished_runs_without_statistics(session: Session) -> list[ReplayRun]:
    """Finished runs whose statistics are not stored."""
    # SQL NULL (what the migration leaves) or a JSON null (None assigned through the ORM).
    missing = or_(ReplayRun.aggregate.is_(None), cast(ReplayRun.aggregate, Text) == "null")
    stmt = select(ReplayRun).where(ReplayRun.status.in_(("done", "failed")), missing)
    return list(session.scalars(stmt.order_by(ReplayRun.id)))


def first_failure(session: Session, run_id: int) -> str | None:
    """The reason of the run's first failed result (None: none failed)."""
    return session.scalar(
        select(R.error).where(R.run_id == run_id, R.status == "failed").order_by(R.id).limit(1)
    )


def result_figures(
    session: Session, run_id: int, comparison: int | None = None
) -> dict[int, list[ResultFigures]]:
    """Per comparison, the figures of every result of the run (or of one comparison), in trace
    order: one indexed scan of small columns (no detail JSON, no token arrays)."""
    stmt = (
        select(
            R.comparison,
            *(getattr(R, f) for f in FIGURE_COLUMNS),  # what `figures` reads
            Trace.public_id,
            Trace.external_id,
        )
        .join(Trace, Trace.id == R.trace_id)
        .where(R.run_id == run_id)
        .order_by(R.comparison, R.trace_id)
    )
    if comparison is not None:
        stmt = stmt.where(R.comparison == comparison)
    out: dict[int, list[ResultFigures]] = {}
    for row in session.execute(stmt):
        out.setdefault(int(row.comparison), []).append(figures(row, row.public_id, row.external_id))
    return out


def resolved_arms(session: Session, run_id: int) -> list[tuple[int, str | None, str | None, int]]:
    """What ran in a run: (comparison, arm A's resolved JSON, arm B's, results) for each
    distinct pair among its ok results (None: the logged tokens, or not recorded)."""
    stmt = (
        select(R.comparison, R.resolved_a, R.resolved_b, func.count())
        .where(R.run_id == run_id, R.status == "ok")
        .group_by(R.comparison, R.resolved_a, R.resolved_b)
        .order_by(R.comparison, func.count().desc())
    )
    return [(int(c), a, b, int(n)) for c, a, b, n in session.execute(stmt).all()]


#: What `_parsed_configs` makes of a stored configuration.
_Parsed = TypeVar("_Parsed")


def _parsed_configs(
    session: Session, trace_ids: Sequence[int], parse: Callable[[str], _Parsed]
) -> dict[int, _Parsed]:
    """Each of `trace_ids`' stored configuration through `parse`, by trace id: one query per
    10,000 traces, each of the (few) configurations parsed once."""
    out: dict[int, _Parsed] = {}
    parsed: dict[int, _Parsed] = {}
    ids = list(trace_ids)
    for start in range(0, len(ids), 10_000):
        rows = session.execute(
            select(Trace.id, NumericalConfigRow.id, NumericalConfigRow.config_json)
            .join(NumericalConfigRow, NumericalConfigRow.id == Trace.config_id)
            .where(Trace.id.in_(ids[start : start + 10_000]))
        )
        for trace_id, config_id, config_json in rows:
            if config_id not in parsed:
                parsed[config_id] = parse(config_json)
            out[int(trace_id)] = parsed[config_id]
    return out


def logging_engines(session: Session, trace_ids: Sequence[int]) -> dict[int, str]:
    """The engine that logged each of `trace_ids` (`config.engine.name`), by trace id."""
    return _parsed_configs(session, trace_ids, logging_engine)


def logged_placements(session: Session, trace_ids: Sequence[int]) -> dict[int, LoggedPlacement]:
    """Where each of `trace_ids` was logged (GPU, TP degree), by trace id."""
    return _parsed_configs(session, trace_ids, lambda c: LoggedPlacement.of(orjson.loads(c)))


def unfinished_queues(session: Session, run_id: int) -> dict[str, int]:
    """The queues of a run's unfinished jobs, with how many wait on each."""
    rows = session.execute(
        select(ReplayJob.queue, func.count())
        .where(ReplayJob.run_id == run_id, ReplayJob.status != "done")
        .group_by(ReplayJob.queue)
    )
    return {str(q): int(n) for q, n in rows}


def exact_matches(
    session: Session, run_id: int, comparison: int, trace_ids: Sequence[int]
) -> dict[int, bool]:
    """Exact-match flags of the ok results of one comparison for `trace_ids`."""
    if not trace_ids:
        return {}
    stmt = select(R.trace_id, exact_of(R)).where(
        R.run_id == run_id,
        R.comparison == comparison,
        R.status == "ok",
        R.trace_id.in_(list(trace_ids)),
    )
    return {int(t): bool(x) for t, x in session.execute(stmt)}


def run_trace_ids(session: Session, run_id: int) -> list[int]:
    """The traces of a run (its jobs' chunks), in job order."""
    chunks = session.scalars(
        select(ReplayJob.trace_ids).where(ReplayJob.run_id == run_id).order_by(ReplayJob.chunk)
    )
    return [int(t) for chunk in chunks for t in chunk]


def paired_outcomes(
    session: Session, run_a: int, comparison_a: int, run_b: int, comparison_b: int
) -> list[PairedOutcome]:
    """Exact-match flags of (run_a, comparison_a) and (run_b, comparison_b) on the traces where
    both are ok and established (a trace a scan-then-decode run only scanned is neither exact
    nor not), by trace id: one indexed join, three small values per trace."""
    a, b, base = pair_join(run_a, comparison_a, run_b, comparison_b)
    stmt = base.add_columns(a.trace_id, exact_of(a), exact_of(b)).order_by(a.trace_id)
    return [PairedOutcome(int(t), bool(x), bool(y)) for t, x, y in session.execute(stmt)]


def pair_join(
    run_a: int, comparison_a: int, run_b: int, comparison_b: int
) -> tuple[Any, Any, Select[Any]]:
    """Results a of (run_a, comparison_a) joined to results b of (run_b, comparison_b) of the
    same trace, both ok and established; the caller adds the columns it reads."""
    a, b = aliased(ReplayResult), aliased(ReplayResult)
    base = (
        select()
        .select_from(a)
        .join(b, and_(b.trace_id == a.trace_id, b.run_id == run_b, b.comparison == comparison_b))
        .where(
            a.run_id == run_a,
            a.comparison == comparison_a,
            a.status == "ok",
            b.status == "ok",
            # Established on both sides: not a trace a scan-then-decode run only scanned.
            a.exact_match.is_not(None),
            b.exact_match.is_not(None),
        )
    )
    return a, b, base


def exact_of(alias: Any) -> ColumnElement[bool]:
    """The result's exact match as a boolean (NULL, a trace only scanned, is False)."""
    return func.coalesce(alias.exact_match, false()) == true()


def trace_refs(session: Session, trace_ids: Sequence[int]) -> dict[int, TraceRef]:
    """Public and external ids of the traces `trace_ids`."""
    if not trace_ids:
        return {}
    stmt = select(Trace.id, Trace.public_id, Trace.external_id).where(
        Trace.id.in_([int(t) for t in trace_ids])
    )
    return {int(i): TraceRef(id=str(p), external_id=e) for i, p, e in session.execute(stmt)}


def has_reference_answers(session: Session, run_id: int) -> bool:
    """Whether some trace of the run carries a reference answer (one indexed probe)."""
    stmt = select(
        select(1)
        .select_from(R)
        .join(Trace, Trace.id == R.trace_id)
        .where(R.run_id == run_id, R.comparison == 0, Trace.reference_answer.is_not(None))
        .exists()
    )
    return bool(session.scalar(stmt))


def answer_figures(session: Session, run_id: int) -> list[AnswerFigures]:
    """The extracted answers of every ok result whose trace has a reference answer (from the
    result's answer columns: no JSON is parsed). The references are read once per trace, not
    once per result (a trace row is wide: its token arrays)."""
    answers = session.execute(
        select(R.comparison, R.trace_id, R.answer_extractor, R.answer_a, R.answer_b)
        .where(R.run_id == run_id, R.status == "ok", R.answer_extractor.is_not(None))
        .order_by(R.trace_id, R.comparison)
    ).all()
    run_traces = select(R.trace_id).where(R.run_id == run_id, R.comparison == 0)
    references = dict(
        session.execute(
            select(Trace.id, Trace.reference_answer).where(
                Trace.id.in_(run_traces), Trace.reference_answer.is_not(None)
            )
        ).all()
    )
    return [
        AnswerFigures(int(c), int(t), str(extractor), a, b, str(references[t]))
        for c, t, extractor, a, b in answers
        if t in references
    ]


def results_page(
    session: Session, run: ReplayRun, *, after: int | None, limit: int
) -> list[tuple[ReplayResult, str]]:
    stmt = (
        select(ReplayResult, Trace.public_id)
        .join(Trace, Trace.id == ReplayResult.trace_id)
        .where(ReplayResult.run_id == run.id)
        .order_by(ReplayResult.id)
        .limit(limit)
    )
    if after is not None:
        stmt = stmt.where(ReplayResult.id > after)
    return [(row[0], row[1]) for row in session.execute(stmt)]


def token_ids_sources(session: Session, trace_ids: Sequence[int]) -> dict[int, str | None]:
    """Where each of `trace_ids`' token ids come from (`results.token_ids_source`), by trace id."""
    return _parsed_configs(session, trace_ids, lambda c: token_ids_source(orjson.loads(c)))


def unfinished_jobs(session: Session) -> list[ReplayJob]:
    """Jobs the database says are not done (the reconciler's work list)."""
    return list(
        session.scalars(select(ReplayJob).where(ReplayJob.status != "done").order_by(ReplayJob.id))
    )


def touch_job(session: Session, job_id: int) -> None:
    session.execute(update(ReplayJob).where(ReplayJob.id == job_id).values(updated_at=utcnow()))
