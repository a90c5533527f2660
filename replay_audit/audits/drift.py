"""A scheduled run's trend point and its drift flags, from the replay run's `RunStatistics`
(typed by `audits/metrics.py`). Pure: the evaluation job, the trend endpoint and the tests
share it. The trend point and every rule, with its test and false-alarm rate, are specified in
docs/audits.md ("Trend and drift", "Verification: a group turned inconsistent").

Every rule is a test on counts (one-sided Fisher exact, or `deterministic` for the self-replay),
never a comparison of point estimates alone. A comparison's baseline is its counts pooled over
the previous TRAILING_RUNS evaluated runs; comparisons are matched across runs by index (a
schedule's targets cannot be edited), verified groups by name. A group that stays inconsistent
is flagged once, when it turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from replay_audit.audits.metrics import (
    DEFAULT_ALPHA,
    DEFAULT_MIN_N,
    CLift,
    ComparisonMetrics,
    DriftTest,
    Flag,
    RunMetrics,
    VerificationMetrics,
)
from replay_audit.replays.domain import RunTarget
from replay_audit.stats.fisher import fisher_exact
from replay_audit.stats.report import RunStatistics

#: How many previous runs the baseline pools.
TRAILING_RUNS: Final = 7
#: Fewer previous runs than this and the EAR-drop rule stays silent (one or two nights are
#: not a baseline).
MIN_TRAILING_RUNS: Final = 3


@dataclass(frozen=True, slots=True)
class DriftRules:
    """The thresholds the rules use: the schedule's `ear_drop_points` (practical size of an
    EAR drop, percentage points), the settings' `alpha` (statistical) and `min_n`."""

    ear_drop_points: float
    alpha: float = DEFAULT_ALPHA
    min_n: int = DEFAULT_MIN_N

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must lie strictly between 0 and 1, got {self.alpha!r}")
        if self.min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {self.min_n!r}")


def run_metrics(stats: RunStatistics, targets: Sequence[RunTarget]) -> RunMetrics:
    """The trend point of one finished replay run (headline numbers: docs/audits.md)."""
    comps: list[ComparisonMetrics] = []
    for c in stats.comparisons:
        b = targets[int(c.b)]
        is_self = b.is_self and c.a == "logged"
        label = (
            b.display_label()
            if c.a == "logged"
            else f"{targets[int(c.a)].display_label()} vs {b.display_label()}"
        )
        kind = b.target.intervention.kind if b.target is not None else "none"
        # A scan-then-decode run's EAR over all scanned traces (its decoded EAR leaves out the
        # traces only scanned): comparable with a decode run's.
        ear = c.screening.ear if c.screening is not None else c.ear
        comps.append(
            ComparisonMetrics(
                index=c.index,
                label=label,
                is_self=is_self,
                intervention="none" if is_self else kind,
                n=c.ok,
                failed=c.failed,
                ear=ear.estimate,
                ear_low=ear.low,
                ear_high=ear.high,
                exact=c.ear.successes,
                trigger_rate=c.trigger_rate,
                categories={k: v.successes for k, v in c.categories.items()},
            )
        )
    baseline = next((c for c in comps if not c.is_self), comps[0] if comps else None)
    treated = c_lift = None
    if baseline is not None and baseline.intervention == "none":
        for lift in stats.lifts:
            cand = next((c for c in comps if c.index == lift.comparison_b), None)
            if lift.comparison_a == baseline.index and cand is not None:
                if cand.intervention != "C":
                    continue
                treated = cand
                c_lift = CLift(
                    lift=lift.lift,
                    low=lift.low,
                    high=lift.high,
                    n=lift.n,
                    fixed=lift.fixed,
                    broke=lift.broke,
                    comparison=cand.index,
                )
                break
    self_comp = next((c for c in comps if c.is_self), None)
    trigger_source = treated or baseline
    return RunMetrics(
        comparisons=comps,
        ear=None if baseline is None else baseline.ear,
        ear_low=None if baseline is None else baseline.ear_low,
        ear_high=None if baseline is None else baseline.ear_high,
        baseline=None if baseline is None else baseline.index,
        c_lift=c_lift,
        trigger_rate=None if trigger_source is None else trigger_source.trigger_rate,
        categories={} if baseline is None else baseline.categories,
        self_agreement=None if self_comp is None else self_comp.ear,
    )


def _counted(history: Sequence[RunMetrics], index: int) -> list[ComparisonMetrics]:
    """The comparison `index` in each of `history`'s runs that recorded its counts."""
    found = (h.comparison(index) for h in history)
    return [c for c in found if c is not None and c.n is not None and c.exact is not None]


def _pct(x: int, n: int) -> str:
    return f"{x}/{n} ({100 * x / n:.1f}%)" if n else f"{x}/{n}"


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


def _ear_drop(
    c: ComparisonMetrics, past: list[ComparisonMetrics], rules: DriftRules
) -> Flag | None:
    if c.n is None or c.exact is None or len(past) < MIN_TRAILING_RUNS:
        return None
    base_x, base_n = sum(p.exact or 0 for p in past), sum(p.n or 0 for p in past)
    if c.n < rules.min_n or base_n < rules.min_n:
        return None
    drop = 100 * (base_x / base_n - c.exact / c.n)
    if drop <= rules.ear_drop_points:
        return None
    result = fisher_exact(c.exact, c.n, base_x, base_n, alternative="less")
    if result.p_value > rules.alpha:
        return None
    return Flag(
        kind="ear_drop",
        comparison=c.index,
        label=c.label,
        test=DriftTest(
            test="fisher_exact_less",
            latest_successes=c.exact,
            latest_n=c.n,
            baseline_successes=base_x,
            baseline_n=base_n,
            baseline_runs=len(past),
            p_value=result.p_value,
            alpha=rules.alpha,
        ),
        drop_points=drop,
        threshold_points=rules.ear_drop_points,
        message=(
            f"{c.label}: EAR {_pct(c.exact, c.n)} vs {_pct(base_x, base_n)} pooled over the "
            f"previous {len(past)} runs: {drop:.1f} points lower (threshold "
            f"{rules.ear_drop_points:g}), one-sided Fisher exact p = {_p(result.p_value)} "
            f"<= alpha {rules.alpha:g}"
        ),
    )


def _self_disagreement(c: ComparisonMetrics, rules: DriftRules) -> Flag | None:
    if c.ear is None or c.ear >= 1.0:
        return None
    n = c.n if c.n is not None else 0
    exact = c.exact if c.exact is not None else round(c.ear * n)
    return Flag(
        kind="self_disagreement",
        comparison=c.index,
        label=c.label,
        test=DriftTest(
            test="deterministic", latest_successes=exact, latest_n=n, p_value=0.0, alpha=rules.alpha
        ),
        message=(
            f"{c.label}: {n - exact} of {n} traces disagree with their own logged configuration "
            f"(agreement {100 * c.ear:.1f}%); a deterministic self-replay agrees on all, so "
            f"any disagreement is a finding (p = 0)"
        ),
    )


def _new_category(
    c: ComparisonMetrics, category: str, k: int, past: list[ComparisonMetrics], rules: DriftRules
) -> Flag | None:
    base_n = sum(p.n or 0 for p in past)
    base_x = sum(p.categories.get(category, 0) for p in past)
    if c.n is None or c.n < rules.min_n or base_n < rules.min_n:
        return None
    result = fisher_exact(k, c.n, base_x, base_n, alternative="greater")
    if result.p_value > rules.alpha:
        return None
    return Flag(
        kind="new_category",
        comparison=c.index,
        label=c.label,
        category=category,
        test=DriftTest(
            test="fisher_exact_greater",
            latest_successes=k,
            latest_n=c.n,
            baseline_successes=base_x,
            baseline_n=base_n,
            baseline_runs=len(past),
            p_value=result.p_value,
            alpha=rules.alpha,
        ),
        message=(
            f"{c.label}: first {category} divergences for this schedule, {_pct(k, c.n)} vs "
            f"{_pct(base_x, base_n)} over the previous {len(past)} runs, one-sided Fisher "
            f"exact p = {_p(result.p_value)} <= alpha {rules.alpha:g}"
        ),
    )


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def turned_inconsistent(
    current: VerificationMetrics, previous: VerificationMetrics | None
) -> list[Flag]:
    """A `group_inconsistent` flag for each group of `current` that is inconsistent and was not
    in `previous` (the last finished verification before it; None: there is none)."""
    flags = []
    for g in current.groups:
        if g.verdict != "inconsistent":
            continue
        before = previous.group(g.group) if previous is not None else None
        if before is not None and before.verdict == "inconsistent":
            continue
        was = (
            f"{before.verdict} in the previous verified run"
            if before is not None
            else "absent from the previous verified run"
            if previous is not None
            else "the schedule's first verdict on it"
        )
        benign = f"; closest benign: {g.closest_benign}" if g.closest_benign else ""
        rate = "" if g.false_alarm_rate is None else f", false-alarm rate {g.false_alarm_rate:g}"
        flags.append(
            Flag(
                kind="group_inconsistent",
                label=g.group,
                group=g.group,
                verdict=g,
                previous_verdict=None if before is None else before.verdict,
                message=(
                    f"{g.group}: inconsistent with the claimed checkpoint, {g.statistic or 'score'}"
                    f" {_num(g.score)} above the benign null's threshold {_num(g.threshold)} at "
                    f"{g.tokens} tokens{rate}{benign} ({was})"
                ),
            )
        )
    return flags


def previous_verification(history: Sequence[RunMetrics]) -> VerificationMetrics | None:
    """The newest finished verification of `history` (oldest first): the one a group's verdict
    now is compared with."""
    for h in reversed(history):
        if h.verification is not None and h.verification.status == "done":
            return h.verification
    return None


def detect_drift(
    current: RunMetrics, history: Sequence[RunMetrics], rules: DriftRules
) -> list[Flag]:
    """The flags of `current` given the schedule's earlier evaluated runs (oldest first): the
    comparisons' drift flags, then the verified groups' (`turned_inconsistent`)."""
    flags: list[Flag] = []
    trailing = history[-TRAILING_RUNS:]
    seen: set[tuple[int, str]] = {
        (c.index, cat)
        for h in history
        for c in h.comparisons
        for cat, n in c.categories.items()
        if n
    }
    for c in current.comparisons:
        past = _counted(trailing, c.index)
        flag = _self_disagreement(c, rules) if c.is_self else _ear_drop(c, past, rules)
        if flag is not None:
            flags.append(flag)
        if history:
            for cat, k in sorted(c.categories.items()):
                if k and cat != "agreed" and (c.index, cat) not in seen:
                    flag = _new_category(c, cat, k, past, rules)
                    if flag is not None:
                        flags.append(flag)
    if current.verification is not None and current.verification.status == "done":
        flags += turned_inconsistent(current.verification, previous_verification(history))
    return flags
