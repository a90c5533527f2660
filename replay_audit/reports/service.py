"""Reports: a run's statistics, any pair of its comparisons, two runs against each other.

Counts and sums come from the database (`repository`), so the cost of a report grows with the
number of comparisons and divergent results, not with the size of the run's rows; the
statistics are the pure `replay_audit.stats` functions, the same the stored aggregate uses
(`replays.aggregate`), so both say the same numbers.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final, TypeVar, cast

from sqlalchemy.orm import Session

from replay_audit.diff import get_extractor
from replay_audit.exceptions import FieldError, NotFound
from replay_audit.replays import service as replays_service
from replay_audit.replays.aggregate import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, CATEGORIES
from replay_audit.replays.models import ReplayResult, ReplayRun
from replay_audit.reports import repository
from replay_audit.reports.repository import ResultFilter, RunFilter
from replay_audit.reports.schemas import (
    AccuracyPair,
    AccuracyReport,
    ArmAccuracy,
    ArmKey,
    ComparisonReport,
    DistributionRead,
    FlipsRead,
    HistogramRead,
    LiftReport,
    LogHistogramRead,
    MarginReport,
    ProportionRead,
    RunComparisonReport,
    RunReport,
    TostRead,
    TraceRef,
)
from replay_audit.stats import (
    correctness_flips,
    distribution,
    histogram,
    log_histogram,
    mcnemar_exact,
    paired_bootstrap_lift,
    proportion,
    tost_noninferiority,
)
from replay_audit.traces.models import Trace

T = TypeVar("T")

#: Default non-inferiority margin for task accuracy: the paper's δ = 0.05 (5 points).
DEFAULT_TOST_MARGIN: Final = 0.05
DEFAULT_TOST_ALPHA: Final = 0.05
#: Fixed / broke traces listed inline in a lift (the rest are paged: `flips_page`).
DEFAULT_LIST_LIMIT: Final = 50
#: Bins of the t* histogram (integer-aligned, so a bin never splits a step).
T_STAR_BINS: Final = 20
#: Bins per decade of the margin histograms.
MARGIN_BINS_PER_DECADE: Final = 2


# -- labels ------------------------------------------------------------------------------------


def target_label(target: Mapping[str, Any]) -> str:
    """A short human name for a resolved target: its label, else e.g. `fp16 + C(τ=0.001)`."""
    if target.get("label"):
        return str(target["label"])
    if target.get("self"):
        return "self"
    parts = [str(target.get("dtype"))]
    if target.get("lm_head_dtype"):
        parts.append(f"head {target['lm_head_dtype']}")
    if target.get("attn_kernel"):
        parts.append(str(target["attn_kernel"]))
    if int(target.get("batch_size") or 1) != 1:
        parts.append(f"bs {target['batch_size']}")
    label = " / ".join(parts)
    iv = target.get("intervention") or {}
    if iv.get("kind", "none") != "none":
        gate = f"{iv['tau_ulps']:g} ulps" if iv.get("tau_ulps") is not None else f"τ={iv['tau']:g}"
        label += f" + {iv['kind']}({gate})"
    return label


def arm_label(run: ReplayRun, arm: ArmKey) -> str:
    if arm == "logged":
        return "logged"
    return f"T{arm}: {target_label(run.targets[int(arm)])}"


def comparison_label(run: ReplayRun, index: int) -> str:
    c = run.comparisons[index]
    return f"{arm_label(run, c['a'])} vs {arm_label(run, c['b'])}"


def _arm(value: Any) -> ArmKey:
    return "logged" if value == "logged" else int(value)


# -- small converters ----------------------------------------------------------------------------


def _prop(successes: int, n: int) -> ProportionRead:
    p = proportion(successes, n)
    return ProportionRead(
        successes=p.successes,
        n=p.n,
        estimate=p.estimate,
        low=p.interval.low,
        high=p.interval.high,
    )


def _finite(values: Sequence[float | int | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _dist(values: Sequence[float | int | None]) -> DistributionRead | None:
    xs = _finite(values)
    return DistributionRead(**asdict(distribution(xs))) if xs else None


def _t_star_histogram(values: Sequence[int | None]) -> HistogramRead | None:
    xs = _finite(values)
    if not xs:
        return None
    width = max(1, math.ceil((max(xs) + 1) / T_STAR_BINS))
    n_bins = math.ceil((max(xs) + 1) / width)
    h = histogram(xs, [float(i * width) for i in range(n_bins + 1)])
    return HistogramRead(edges=list(h.edges), counts=list(h.counts))


def _decades(groups: Sequence[Sequence[float]]) -> tuple[int, int] | None:
    """One log axis for every margin histogram of a run (so they can be compared by eye)."""
    positive = [v for g in groups for v in g if v > 0]
    if not positive:
        return None
    lo = math.floor(math.log10(min(positive)))
    hi = max(math.ceil(math.log10(max(positive))), lo + 1)
    return lo, hi


def _log_hist(values: Sequence[float], decades: tuple[int, int] | None) -> LogHistogramRead | None:
    xs = [v for v in values if v >= 0]
    if not xs:
        return None
    if decades is None:  # only zeros: no bins, the zero count alone
        return LogHistogramRead(edges=[], counts=[], zeros=len(xs), below=0, above=0)
    h = log_histogram(xs, decades=decades, bins_per_decade=MARGIN_BINS_PER_DECADE)
    return LogHistogramRead(
        edges=list(h.edges), counts=list(h.counts), zeros=h.zeros, below=h.below, above=h.above
    )


# -- one run -----------------------------------------------------------------------------------


def get_run(session: Session, project_id: int, public_id: str) -> ReplayRun:
    """The project's run `public_id`; NotFound for an unknown id or another project's run."""
    return replays_service.get_replay(session, project_id, public_id)


def _comparison_reports(session: Session, run: ReplayRun) -> list[ComparisonReport]:
    counts = repository.comparison_counts(session, run.id)
    values = repository.diverged_values(session, run.id)
    margins = {
        c: (
            _finite(v.margin_replay),
            _finite(v.margin_logged),
            _finite(v.margin_replay_ulps),
            _finite(v.margin_logged_ulps),
        )
        for c, v in values.items()
    }
    abs_axis = _decades([g for m in margins.values() for g in m[:2]])
    ulps_axis = _decades([g for m in margins.values() for g in m[2:]])
    out = []
    for comp in run.comparisons:
        idx = int(comp["index"])
        n = counts.get(idx)
        v = values.get(idx)
        m = margins.get(idx, ([], [], [], []))
        ok = n.ok if n else 0
        category_counts = n.categories if n else {}
        out.append(
            ComparisonReport(
                index=idx,
                a=_arm(comp["a"]),
                b=_arm(comp["b"]),
                label=comparison_label(run, idx),
                n=n.n if n else 0,
                ok=ok,
                failed=(n.n - n.ok) if n else 0,
                ear=_prop(n.exact if n else 0, ok),
                sar=_prop(n.semantic_agree, n.semantic_n) if n and n.semantic_n else None,
                steps=n.steps if n else 0,
                gate_triggers=n.gate_triggers if n else 0,
                trigger_rate=n.gate_triggers / n.steps if n and n.steps else None,
                mean_gap=n.gap_sum / n.steps if n and n.steps and n.has_gap else None,
                categories={c: _prop(category_counts.get(c, 0), ok) for c in CATEGORIES},
                first_divergence_step=_dist(v.first_divergence_step) if v else None,
                t_star_histogram=_t_star_histogram(v.first_divergence_step) if v else None,
                margin_at_divergence=MarginReport(
                    replay=_dist(m[0]),
                    logged=_dist(m[1]),
                    replay_ulps=_dist(m[2]),
                    logged_ulps=_dist(m[3]),
                    ties=n.ties if n else 0,
                    histogram_replay=_log_hist(m[0], abs_axis),
                    histogram_logged=_log_hist(m[1], abs_axis),
                    histogram_replay_ulps=_log_hist(m[2], ulps_axis),
                    histogram_logged_ulps=_log_hist(m[3], ulps_axis),
                ),
                length_difference=_dist(v.length_difference) if v else None,
            )
        )
    return out


def _check_comparison(run: ReplayRun, index: int, field: str) -> int:
    if not 0 <= index < len(run.comparisons):
        raise FieldError(
            f"{field}: run {run.public_id} has comparisons 0 to {len(run.comparisons) - 1}",
            field=field,
        )
    return index


def lift_between(
    session: Session,
    run_a: ReplayRun,
    comparison_a: int,
    run_b: ReplayRun,
    comparison_b: int,
    *,
    list_limit: int = DEFAULT_LIST_LIMIT,
) -> LiftReport:
    """EAR lift of (run_b, comparison_b) over (run_a, comparison_a), paired by trace: seeded
    paired bootstrap interval, exact McNemar test, and the traces fixed and broke."""
    _check_comparison(run_a, comparison_a, "a")
    _check_comparison(run_b, comparison_b, "b")
    return _memoised(
        [run_a, run_b],
        ("lift", comparison_a, comparison_b, list_limit),
        lambda: _lift(session, run_a, comparison_a, run_b, comparison_b, list_limit),
    )


def _lift(
    session: Session,
    run_a: ReplayRun,
    comparison_a: int,
    run_b: ReplayRun,
    comparison_b: int,
    list_limit: int,
) -> LiftReport:
    pairs = repository.paired_flags(session, run_a.id, comparison_a, run_b.id, comparison_b)
    n = int(pairs.trace_ids.size)
    fixed_mask = pairs.exact_b & ~pairs.exact_a
    broke_mask = pairs.exact_a & ~pairs.exact_b
    fixed, broke = int(fixed_mask.sum()), int(broke_mask.sum())
    exact_a, exact_b = int(pairs.exact_a.sum()), int(pairs.exact_b.sum())
    lift = low = high = None
    if n:
        res = paired_bootstrap_lift(
            pairs.exact_a.tolist(),
            pairs.exact_b.tolist(),
            resamples=BOOTSTRAP_RESAMPLES,
            seed=BOOTSTRAP_SEED,
        )
        lift, low, high = res.lift, res.low, res.high
    test = mcnemar_exact(broke, fixed)
    # The first `list_limit` of each kind, by trace id (the order of the flips page).
    fixed_ids = pairs.trace_ids[fixed_mask][:list_limit].tolist()
    broke_ids = pairs.trace_ids[broke_mask][:list_limit].tolist()
    refs = repository.trace_refs(session, fixed_ids + broke_ids)

    def listed(ids: list[int]) -> list[TraceRef]:
        return [TraceRef(id=refs[t][0], external_id=refs[t][1]) for t in ids]

    return LiftReport(
        run_a=run_a.public_id,
        comparison_a=comparison_a,
        run_b=run_b.public_id,
        comparison_b=comparison_b,
        label_a=comparison_label(run_a, comparison_a),
        label_b=comparison_label(run_b, comparison_b),
        n=n,
        ear_a=exact_a / n if n else None,
        ear_b=exact_b / n if n else None,
        lift=lift,
        low=low,
        high=high,
        confidence=0.95,
        resamples=BOOTSTRAP_RESAMPLES,
        seed=BOOTSTRAP_SEED,
        fixed=fixed,
        broke=broke,
        mcnemar_p=test.p_value,
        fixed_traces=listed(fixed_ids),
        broke_traces=listed(broke_ids),
        fixed_more=fixed > list_limit,
        broke_more=broke > list_limit,
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
    _check_comparison(run_a, comparison_a, "a")
    _check_comparison(run_b, comparison_b, "b")
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


Correctness = tuple[dict[ArmKey, dict[int, bool]], list[str]]


def _correctness(session: Session, run: ReplayRun) -> Correctness:
    """Per arm, per trace: was the arm's extracted answer the reference answer? And which
    extractors were used. Arms without any answer are absent."""
    correct: dict[ArmKey, dict[int, bool]] = {}
    if not repository.has_reference_answers(session, run.id):
        return correct, []
    references: dict[tuple[str, int], str | None] = {}
    extractors: set[str] = set()
    for row in repository.answer_rows(session, run.id):
        try:
            extract = get_extractor(row.extractor)
        except KeyError:
            continue  # an extractor this process does not know: not counted
        key = (row.extractor, row.trace_id)
        if key not in references:
            references[key] = extract(row.reference_answer)
        ref = references[key]
        if ref is None:
            continue  # the reference itself has no extractable answer
        extractors.add(row.extractor)
        comp = run.comparisons[row.comparison]
        for arm, answer in ((comp["a"], row.logged_answer), (comp["b"], row.replay_answer)):
            correct.setdefault(_arm(arm), {}).setdefault(row.trace_id, answer == ref)
    return correct, sorted(extractors)


def _accuracy(
    session: Session, run: ReplayRun, margin: float, alpha: float
) -> AccuracyReport | None:
    # The answers are the costly part and do not depend on the margin: memoised apart.
    correct, extractors = _memoised([run], ("correctness",), lambda: _correctness(session, run))
    if not correct:
        return None
    order: list[ArmKey] = ["logged"] if "logged" in correct else []
    order += sorted(k for k in correct if isinstance(k, int))
    arms = [
        ArmAccuracy(
            arm=k,
            label=arm_label(run, k),
            accuracy=_prop(sum(correct[k].values()), len(correct[k])),
        )
        for k in order
    ]
    pairs = []
    base_key = order[0]
    for k in order[1:]:
        common = sorted(correct[base_key].keys() & correct[k].keys())
        base = [correct[base_key][t] for t in common]
        treat = [correct[k][t] for t in common]
        tost = None
        if common:
            flips = correctness_flips(base, treat)
            r = tost_noninferiority(base, treat, margin=margin, alpha=alpha)
            tost = TostRead(
                diff=r.diff,
                low=r.low,
                high=r.high,
                p_value=r.p_value,
                non_inferior=r.non_inferior,
                margin=r.margin,
                alpha=r.alpha,
                confidence=r.confidence,
            )
            flips_read = FlipsRead(
                gained=flips.gained, lost=flips.lost, n=flips.n, flip_rate=flips.flip_rate
            )
        else:
            flips_read = FlipsRead(gained=0, lost=0, n=0, flip_rate=None)
        pairs.append(
            AccuracyPair(
                baseline=base_key,
                treated=k,
                label_baseline=arm_label(run, base_key),
                label_treated=arm_label(run, k),
                flips=flips_read,
                tost=tost,
            )
        )
    n_traces = len(set().union(*(v.keys() for v in correct.values())))
    return AccuracyReport(
        extractors=extractors,
        n_traces=n_traces,
        arms=arms,
        pairs=pairs,
        margin=margin,
        alpha=alpha,
    )


#: Parts of reports of finished runs kept per process: a finished run's results never change
#: (finalising it again gives it a new finished_at, part of the key), so its comparisons, lifts
#: and accuracy are computed once per process and parameters. Least recently used first out.
MEMO_SIZE: Final = 256
_memo: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_memo_lock = threading.Lock()


def _finished(run: ReplayRun) -> tuple[str, str] | None:
    if run.status not in ("done", "failed") or run.finished_at is None:
        return None
    return run.public_id, run.finished_at.isoformat()


def _memoised(runs: Sequence[ReplayRun], params: tuple[Any, ...], compute: Callable[[], T]) -> T:
    """compute(), remembered when every run in `runs` is finished."""
    ids = [_finished(r) for r in runs]
    if any(i is None for i in ids):
        return compute()
    key = (*ids, *params)
    with _memo_lock:
        if key in _memo:
            _memo.move_to_end(key)
            return cast(T, _memo[key])
    value = compute()  # outside the lock: two threads may both compute; both get the same
    with _memo_lock:
        _memo[key] = value
        while len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)
    return value


def clear_memo() -> None:
    """Forget every memoised report part (tests, benchmarks)."""
    with _memo_lock:
        _memo.clear()


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
    """Statistics of `run` (finished or not): each comparison, every comparison's lift over
    comparison 0, the lift of `pair` = (a, b) (b over a), and, `with_accuracy`, task accuracy
    where the traces carry reference answers (`accuracy_report`). The parts of a finished
    run's report are memoised (see MEMO_SIZE)."""
    if pair is not None:
        _check_comparison(run, pair[0], "a")
        _check_comparison(run, pair[1], "b")
    lifts = [
        lift_between(session, run, 0, run, i, list_limit=list_limit)
        for i in range(1, len(run.comparisons))
    ]
    return RunReport(
        run_id=run.public_id,
        status=run.status,
        partial=run.status not in ("done", "failed"),
        n_traces=run.n_traces,
        n_results=run.n_items,
        comparisons=_memoised(
            [run], ("comparisons",), lambda: _comparison_reports(session, run)
        ),
        lifts=lifts,
        pair=lift_between(session, run, pair[0], run, pair[1], list_limit=list_limit)
        if pair is not None
        else None,
        accuracy=accuracy_report(session, run, margin=margin, alpha=alpha)
        if with_accuracy
        else None,
    )


def accuracy_report(
    session: Session,
    run: ReplayRun,
    *,
    margin: float = DEFAULT_TOST_MARGIN,
    alpha: float = DEFAULT_TOST_ALPHA,
) -> AccuracyReport | None:
    """Task accuracy per arm against the traces' reference answers, correctness flips and the
    TOST non-inferiority test (at `margin`, level `alpha`) of every arm against the first; None
    when no trace of the run carries a reference answer.

    The extracted answers come from the results' answer columns (see migration 0004)."""
    if not 0.0 <= margin < 1.0:
        raise FieldError(f"margin must lie in [0, 1), got {margin}", field="margin")
    if not 0.0 < alpha < 0.5:
        raise FieldError(f"alpha must lie in (0, 0.5), got {alpha}", field="alpha")
    return _memoised(
        [run], ("accuracy", margin, alpha), lambda: _accuracy(session, run, margin, alpha)
    )


def has_reference_answers(session: Session, run: ReplayRun) -> bool:
    """Whether some trace of the run carries a reference answer (cheap)."""
    return repository.has_reference_answers(session, run.id)


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
    pair = lift_between(
        session, run_a, comparison_a, run_b, comparison_b, list_limit=list_limit
    )
    return RunComparisonReport(
        run_a=run_report(session, run_a, list_limit=list_limit, with_accuracy=False),
        run_b=run_report(session, run_b, list_limit=list_limit, with_accuracy=False),
        pair=pair,
        common_traces=pair.n,
    )


# -- lists -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSummary:
    run: ReplayRun
    models: list[str]
    targets: list[str]
    #: EAR of comparison 0 from the stored aggregate (finished runs only).
    ear: dict[str, Any] | None


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
        comps = (r.aggregate or {}).get("comparisons") or []
        items.append(
            RunSummary(
                run=r,
                models=models.get(r.id, []),
                targets=[target_label(t) for t in r.targets],
                ear=comps[0]["ear"] if comps else None,
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
        _check_comparison(run, f.comparison, "comparison")
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


def project_model_names(session: Session, project_id: int) -> list[str]:
    """The model names of the project's traces (the runs list's filter choices)."""
    return repository.project_model_names(session, project_id)


def neighbour_traces(
    session: Session, run: ReplayRun, trace: Trace, comparison: int
) -> tuple[str | None, str | None]:
    """The previous and next divergent trace of `comparison` (to page through divergences)."""
    return repository.neighbour_traces(session, run.id, trace.id, comparison)
