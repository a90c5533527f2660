"""A run's statistics: the result figures from the database through the one pure builder
(`replay_audit.stats.report`).

A finished run's statistics are stored when it finishes (`service.finalise_run`) and read
back from then on; a running run (or one finished by an earlier release, whose stored aggregate
had another shape) gets the same function over its rows. Nothing is memoised in the process:
the stored object is the cache, and it lives in the database every process reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

from pydantic import ValidationError
from sqlalchemy.orm import Session

from replay_audit.diff import get_extractor
from replay_audit.exceptions import FieldError
from replay_audit.formats import Mode
from replay_audit.replays import repository
from replay_audit.replays.domain import Comparison, arm_label, comparison_label, is_treatment
from replay_audit.replays.models import ReplayRun
from replay_audit.stats.report import (
    DEFAULT_LIST_LIMIT,
    DEFAULT_TOST_ALPHA,
    DEFAULT_TOST_MARGIN,
    AccuracyReport,
    ComparisonInput,
    EngineCheckInput,
    LiftReport,
    LiftSides,
    RunStatistics,
    accuracy_report,
    flipped_ids,
    lift_from_pairs,
    run_statistics,
)


def _extractor(name: str) -> Callable[[str], str | None] | None:
    try:
        return get_extractor(name)
    except KeyError:
        return None  # an extractor this process does not know: its answers are not counted


def comparison_mode(run: ReplayRun, index: int) -> Mode:
    """The mode comparison `index`'s results were produced in: the run's for a comparison
    against the logged tokens; a pairwise comparison decodes both arms in every mode
    (`pipeline.compare_arms`). What SAR can count (`stats.report.SAR_NOTES`)."""
    if Comparison.from_json(run.comparisons[index]).against_logged:
        return cast(Mode, run.mode)
    return "decode"


def comparison_inputs(
    session: Session, run: ReplayRun, *, figures: bool = True
) -> list[ComparisonInput]:
    """Every comparison of the run with its results' figures (none with `figures=False`)."""
    targets = run.run_targets
    rows = repository.result_figures(session, run.id) if figures else {}
    control = run.control_sample
    return [
        ComparisonInput(
            index=c.index,
            a=c.a,
            b=c.b,
            label=comparison_label(c, targets),
            treatment=is_treatment(c, targets),
            figures=rows.get(c.index, []),
            control_fraction=control.fraction if control is not None else None,
            control_seed=control.seed if control is not None else None,
            scan_flag_ulps=control.flag_ulps if control is not None else None,
            flagged_fraction=control.flagged_fraction if control is not None else None,
            mode=comparison_mode(run, c.index),
            # Only decodes compared with the logged tokens stop at the window.
            decode_window=run.decode_window if c.against_logged else None,
        )
        for c in run.run_comparisons
    ]


def accuracy(
    session: Session,
    run: ReplayRun,
    inputs: list[ComparisonInput] | None = None,
    *,
    margin: float = DEFAULT_TOST_MARGIN,
    alpha: float = DEFAULT_TOST_ALPHA,
) -> AccuracyReport | None:
    """Task accuracy per arm (None when no trace of the run has a reference answer)."""
    if not repository.has_reference_answers(session, run.id):
        return None
    # Accuracy needs each comparison's arms, not its figures: no result rows are loaded here.
    comparisons = inputs if inputs is not None else comparison_inputs(session, run, figures=False)
    return accuracy_report(
        repository.answer_figures(session, run.id),
        comparisons,
        extract=_extractor,
        arm_label=partial(arm_label, targets=run.run_targets),
        margin=margin,
        alpha=alpha,
    )


def has_reference_answers(session: Session, run: ReplayRun) -> bool:
    return repository.has_reference_answers(session, run.id)


def engine_check_comparison(run: ReplayRun) -> int | None:
    """The comparison of the logged tokens with a self replay, if the run has one."""
    targets = run.run_targets
    return next(
        (c.index for c in run.run_comparisons if c.against_logged and targets[c.b].is_self),
        None,
    )


def engine_check(session: Session, run: ReplayRun) -> EngineCheckInput | None:
    """The run's reproduction check: its comparison of the logged tokens with a self replay,
    over all the run's traces with their logging engines (None when it has none)."""
    index = engine_check_comparison(run)
    if index is None:
        return None
    engines = repository.logging_engines(session, repository.run_trace_ids(session, run.id))
    return EngineCheckInput(index, engines) if engines else None


def engine_reproduced(
    session: Session, run: ReplayRun, trace_ids: Sequence[int]
) -> dict[int, bool]:
    """For those of `trace_ids` whose reproduction check has finished ok: whether their logged
    tokens reproduced here in their own logged configuration (the self replay was exact)."""
    index = engine_check_comparison(run)
    if index is None:
        return {}
    return repository.exact_matches(session, run.id, index, list(trace_ids))


def compute(session: Session, run: ReplayRun) -> RunStatistics:
    """The run's statistics from its result rows, now."""
    inputs = comparison_inputs(session, run)
    return run_statistics(
        run.public_id,
        inputs,
        accuracy=accuracy(session, run, inputs),
        engine_check=engine_check(session, run),
    )


def stored(run: ReplayRun) -> RunStatistics | None:
    """The statistics stored when the run finished (None while it runs, or when a run
    finished under an earlier release)."""
    if run.status not in ("done", "failed") or not run.aggregate:
        return None
    try:
        return RunStatistics.model_validate(run.aggregate)
    except ValidationError:
        return None


def check_comparison(run: ReplayRun, index: int, field: str) -> None:
    """A 422 naming `field` unless the run has comparison `index`."""
    if not 0 <= index < len(run.comparisons):
        raise FieldError(
            f"{field}: run {run.public_id} has comparisons 0 to {len(run.comparisons) - 1}",
            field=field,
        )


def of_run(session: Session, run: ReplayRun) -> RunStatistics:
    """The run's statistics: the stored ones of a finished run, else computed from its rows."""
    return stored(run) or compute(session, run)


def lift_between(
    session: Session,
    run_a: ReplayRun,
    comparison_a: int,
    run_b: ReplayRun,
    comparison_b: int,
    *,
    list_limit: int = DEFAULT_LIST_LIMIT,
) -> LiftReport:
    """EAR lift of (run_b, comparison_b) over (run_a, comparison_a), paired by trace (seeded
    paired bootstrap interval, exact McNemar test, the traces fixed and broke): the same builder
    as the stored lifts, for any pair of comparisons of one run or of two runs. A comparison a
    run does not have is a 422 naming `a` or `b`."""
    check_comparison(run_a, comparison_a, "a")
    check_comparison(run_b, comparison_b, "b")
    pairs = repository.paired_outcomes(session, run_a.id, comparison_a, run_b.id, comparison_b)
    fixed, broke = flipped_ids(pairs, list_limit)
    refs = repository.trace_refs(session, fixed + broke)
    sides = LiftSides(
        run_a.public_id,
        comparison_a,
        comparison_label(run_a.run_comparisons[comparison_a], run_a.run_targets),
        run_b.public_id,
        comparison_b,
        comparison_label(run_b.run_comparisons[comparison_b], run_b.run_targets),
    )
    return lift_from_pairs(pairs, sides, refs, list_limit=list_limit)


def store_missing(session: Session) -> int:
    """Store the statistics of finished runs that have none (migrations 0005 and 0012 cleared
    the stored statistics of earlier layouts); how many. `db upgrade` and `serve` call
    it after migrating, so lists that read stored statistics show those runs' figures too."""
    runs = repository.finished_runs_without_statistics(session)
    for run in runs:
        run.aggregate = compute(session, run).model_dump(mode="json")
    return len(runs)
