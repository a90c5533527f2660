"""The one statistics builder of a replay run: per-comparison result figures in, typed comparison,
lift and accuracy reports out. Pure (stdlib, numpy, pydantic for the typed output). Every
surface reads what it builds (`RunStatistics`, the run's `aggregate`); a run still replaying
gets the same function over the results stored so far.

Where a pure `stats` function already returns a frozen dataclass (`Distribution`, `Histogram`,
`LogHistogram`, `TostResult`), that dataclass is the field itself, its schema derived by
pydantic, not copied into a `...Read` twin.

Definitions (docs/replays.md, "Reading results", "Modes", "Lifts", says each at length):
    EAR            exact matches / ok results, Wilson 95% interval
    SAR            equal extracted answers / ok results with an extraction (two arms that both
                   give no answer agree, counted in `sar_neither_answered`); mode-aware, see
                   SAR_NOTES
    trigger rate   gate firings over replayed steps, pooled over traces, for arm B and, where
                   arm A was run here, arm A
    mean gap       mean margin over arm B's replayed steps, pooled (weighted by steps)
    categories     share of each category among the ok results, Wilson intervals
    screening      (scan-then-decode) EAR and categories count only the established results
                   (decoded, or flagged by a mismatch and kept as the scan's: flagged_scanned,
                   divergent by the scan). From the control sample: p = diverged / control
                   (Wilson); from the flagged sample: q = false flags / flagged decoded and
                   r = near-tie diverged / near-tie decoded (Wilson). Estimated misses =
                   p x unflagged, miss rate = misses / (flagged divergences + flagged_scanned
                   x (1 - q) + near_tie_scanned x r + misses), near-tie flags counted as flags;
                   EAR of all scanned = (exact decoded flags + flagged_scanned x q +
                   near_tie_scanned x (1 - r) + unflagged x (1 - p)) / scanned. Each interval
                   is the formula (monotone in each) at the corners of the box of p's, q's and
                   r's intervals that make it least and most; with every flagged trace decoded
                   (flagged_scanned and near_tie_scanned 0), p's alone
    decode window  a `window_cut` result counts in every figure fixed at t* and in the per-step
                   ones, never in SAR, task accuracy or the length difference (they read the
                   continuation, of which it holds a prefix)
    lift           EAR(treated) - EAR(baseline) paired on the traces both established: seeded
                   paired bootstrap interval, exact McNemar p, the traces fixed and broke. Only
                   treatments get one: a self-replay comparison is a reproducibility check.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from pydantic import Field

from replay_audit.formats import BASELINES, CATEGORIES, ArmKey, Mode
from replay_audit.output import StoredModel
from replay_audit.stats.equivalence import TostResult, tost_noninferiority
from replay_audit.stats.mcnemar import mcnemar_exact
from replay_audit.stats.paired import correctness_flips, paired_bootstrap_lift
from replay_audit.stats.proportion import proportion
from replay_audit.stats.summary import (
    Distribution,
    Histogram,
    LogHistogram,
    finite_distribution,
    histogram,
    log_histogram,
)
from replay_audit.words import counted

#: Resamples of the paired bootstrap behind each lift interval (seeded: reproducible).
BOOTSTRAP_RESAMPLES: Final = 10_000
BOOTSTRAP_SEED: Final = 0
#: Fixed / broke traces listed inline in a lift (the rest are paged from the database).
DEFAULT_LIST_LIMIT: Final = 50
#: Bins of the t* histogram (integer-aligned, so a bin never splits a step).
T_STAR_BINS: Final = 20
#: Bins per decade of the margin histograms.
MARGIN_BINS_PER_DECADE: Final = 2
#: Default non-inferiority margin for task accuracy: the paper's δ = 0.05 (5 points).
DEFAULT_TOST_MARGIN: Final = 0.05
DEFAULT_TOST_ALPHA: Final = 0.05
#: Why a comparison's SAR is not over all its ok results, by the mode its results were
#: produced in (`ComparisonReport.sar_note`; none in decode mode).
SAR_NOTES: Final[dict[str, str]] = {
    "scan": "n/a: a scan has no replay text",
    "scan_then_decode": "decoded traces only (a trace only scanned has no replay text)",
}


# -- input -------------------------------------------------------------------------------------


class ResultFigures(NamedTuple):
    """What the statistics read of one result (one trace x comparison): the result columns."""

    trace_id: int
    trace_public_id: str
    external_id: str | None
    status: str
    exact_match: bool | None
    first_divergence_step: int | None
    category: str | None
    margin_a: float | None
    margin_a_ulps: float | None
    margin_b: float | None
    margin_b_ulps: float | None
    gate_triggers: int | None
    n_steps: int | None
    mean_gap: float | None
    gate_triggers_a: int | None
    n_steps_a: int | None
    length_difference: int | None
    answer_extractor: str | None
    answer_a: str | None
    answer_b: str | None
    #: scan-then-decode: why it was decoded, or not (`formats.Screen`); None in other modes.
    screen: str | None = None
    #: Its decode stopped at the run's decode window after t* (module docstring).
    window_cut: bool | None = None
    #: What it was judged against (`formats.Baseline`; None: rows of earlier releases, "logged").
    baseline: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def exact(self) -> bool:
        return self.ok and bool(self.exact_match)

    @property
    def established(self) -> bool:
        """An ok result whose exact match a replay established (not a trace only scanned)."""
        return self.ok and self.exact_match is not None

    @property
    def diverged(self) -> bool:
        return self.ok and self.exact_match is False


@dataclass(frozen=True)
class ComparisonInput:
    """One comparison of a run and its results' figures (any order; one per trace)."""

    index: int
    a: ArmKey
    b: ArmKey
    label: str
    #: Gets a lift over the baseline (False for the baseline itself and self-replays).
    treatment: bool
    figures: Sequence[ResultFigures]
    #: The run's control sample (scan-then-decode runs): its fraction and seed, as recorded.
    control_fraction: float | None = None
    control_seed: int | None = None
    #: The run's near-tie flag in ulps (negative: off), as recorded.
    scan_flag_ulps: float | None = None
    #: The run's flagged sample: the share of flagged traces decoded (by a mismatch or a
    #: near-tie), as recorded.
    flagged_fraction: float | None = None
    #: The mode the results were produced in (what SAR can count: see SAR_NOTES).
    mode: Mode = "decode"
    #: The run's decode window, as recorded (None: decoded to eos or the budget).
    decode_window: int | None = None


@dataclass(frozen=True)
class EngineCheckInput:
    """A run's reproduction check: comparison `comparison` replays each trace in its own logged
    configuration (logged vs self), and `engines` names the engine that logged each trace of
    the run (trace id -> engine name)."""

    comparison: int
    engines: Mapping[int, str]


class AnswerFigures(NamedTuple):
    """One ok result's extracted answers and its trace's reference answer."""

    comparison: int
    trace_id: int
    extractor: str
    answer_a: str | None
    answer_b: str | None
    reference_answer: str


# -- output ------------------------------------------------------------------------------------


class ProportionRead(StoredModel):
    """successes / n with its Wilson 95% interval; `estimate` is None when n == 0. (Flat, where
    `stats.Proportion` nests its interval: the JSON shape every surface has always read.)"""

    successes: int
    n: int
    estimate: float | None
    low: float
    high: float

    @classmethod
    def of(cls, successes: int, n: int) -> ProportionRead:
        p = proportion(successes, n)
        return cls(
            successes=successes, n=n, estimate=p.estimate, low=p.interval.low, high=p.interval.high
        )


class MarginReport(StoredModel):
    """The margin at t* of the divergent results, per arm, absolute and in ulps."""

    a: Distribution | None
    a_ulps: Distribution | None
    b: Distribution | None
    b_ulps: Distribution | None
    #: Divergences where either arm's margin at t* is exactly 0 (a tie in that format).
    ties: int
    histogram_a: LogHistogram | None
    histogram_b: LogHistogram | None
    histogram_a_ulps: LogHistogram | None
    histogram_b_ulps: LogHistogram | None


class EstimateRead(StoredModel):
    """An estimate with its 95% interval (None where nothing was measured)."""

    estimate: float | None
    low: float | None
    high: float | None


class ScreeningReport(StoredModel):
    """What a scan-then-decode comparison scanned and decoded, and what its control sample says
    the scan misses (see the module docstring)."""

    #: Ok results scanned (every trace of the comparison that did not fail).
    scanned: int
    #: Flagged by the scan's mismatch: the flagged sample decoded from its first disagreement
    #: (`flagged_decoded`) and the others, whose result is the scan's (`flagged_scanned`).
    flagged: int
    #: Mismatch-flagged traces in the flagged sample, decoded from their first disagreement.
    #: (Statistics stored before the flagged sample: None, every flagged trace was decoded.)
    flagged_decoded: int | None = None
    #: Mismatch-flagged traces not in it: not decoded, the scan's result (t* = s), counted in
    #: the estimates below as diverging with probability 1 - false_flag_rate.
    flagged_scanned: int = 0
    #: The run's flagged fraction, as recorded (None: not recorded, 1).
    flagged_fraction: float | None = None
    #: Flagged by a near-tie (no mismatch; some step's margin at most `scan_flag_ulps` ulps):
    #: the flagged sample's, decoded in full (`near_tie_decoded`), and the others, only
    #: scanned (`near_tie_scanned`); not in the control sample.
    near_tie: int = 0
    #: Near-tie traces in the flagged sample, decoded in full. (Statistics stored before the
    #: flagged sample covered near-ties: None, every near-tie trace was decoded.)
    near_tie_decoded: int | None = None
    #: Near-tie traces not in it: only scanned (unknown), counted in the estimates below as
    #: diverging with probability near_tie_divergence.
    near_tie_scanned: int = 0
    #: Decoded near-tie traces whose decode diverged: what the mismatch alone would have missed.
    near_tie_diverged: int = 0
    #: near_tie_diverged / near_tie_decoded with its Wilson interval. (None in statistics
    #: stored before it.)
    near_tie_divergence: ProportionRead | None = None
    #: The run's near-tie flag in ulps (negative: off; None: not recorded).
    scan_flag_ulps: float | None = None
    #: Decoded: flagged_decoded + near_tie_decoded + control.
    decoded: int
    #: Why each decoded trace was decoded: {"mismatch", "near_tie", "control"} -> count.
    decoded_by_reason: dict[str, int] = Field(default_factory=dict)
    #: Only scanned (flagged by neither rule, not in the control sample): counted in no EAR.
    scanned_only: int
    #: The control sample: unflagged traces decoded in full, and the recorded fraction and seed.
    control: int
    control_fraction: float | None
    control_seed: int | None
    #: Control traces whose decode diverged: the misses found, by category.
    control_diverged: int
    misses_by_category: dict[str, int]
    #: Decoded mismatch-flagged traces whose decode did not diverge (a near-tie flag that does
    #: not diverge is the flag's cost: near_tie - near_tie_diverged). Of the flagged sample.
    false_flags: int
    #: Decoded mismatch-flagged traces whose decode diverged. Of the flagged sample.
    flagged_diverged: int
    #: false_flags / flagged_decoded with its Wilson interval: the share of the scan's
    #: mismatch flags a decode does not confirm. (None in statistics stored before it.)
    false_flag_rate: ProportionRead | None = None
    #: Divergence rate of the unflagged traces (control_diverged / control, Wilson).
    unflagged_divergence: ProportionRead
    #: Estimated unflagged traces that diverge (unflagged x rate), with its interval.
    estimated_misses: EstimateRead
    #: Share of the decode divergences the scan does not flag (the flagged_scanned traces'
    #: divergences estimated from the false-flag rate, the near_tie_scanned ones' from the
    #: near-tie divergence rate).
    miss_rate: EstimateRead
    #: EAR over all scanned traces (decoded ones as decoded; flagged_scanned ones exact at the
    #: false-flag rate; near_tie_scanned ones at 1 - near-tie divergence; unflagged ones at
    #: 1 - rate).
    ear: EstimateRead


class ComparisonReport(StoredModel):
    """One comparison of the run (arm a vs arm b over the run's traces)."""

    index: int
    a: ArmKey
    b: ArmKey
    label: str
    #: Whether this comparison gets a lift over comparison 0 (not the baseline, not self).
    treatment: bool
    #: The mode its results were produced in. Required: statistics stored before it existed
    #: (a scan's SAR over its agreed traces) fail to validate and are computed afresh.
    mode: Mode
    n: int
    ok: int
    failed: int
    ear: ProportionRead
    #: None where no answer was extracted, or where there is no replay text (a scan).
    sar: ProportionRead | None
    #: What SAR covers or why there is none (`SAR_NOTES`); None in decode mode.
    sar_note: str | None
    #: Results with an extraction where neither arm gave an answer (they count as agreeing).
    sar_neither_answered: int
    steps: int
    gate_triggers: int
    trigger_rate: float | None
    mean_gap: float | None
    #: Arm A's gate firings and steps where arm A was run here (both-arms comparisons).
    steps_a: int | None
    gate_triggers_a: int | None
    trigger_rate_a: float | None
    #: Share of each category among the ok results, with Wilson intervals.
    categories: dict[str, ProportionRead]
    first_divergence_step: Distribution | None
    t_star_histogram: Histogram | None
    margin_at_divergence: MarginReport
    length_difference: Distribution | None
    #: The ok results by what they were judged against (`formats.Baseline`: "logged" tokens,
    #: or the logged configuration replayed here, "reproduced" for traces that did not
    #: reproduce in it, "replayed" for traces of engines this service cannot run): no
    #: precision flip is counted against logged tokens that did not reproduce.
    baselines: dict[str, int] = Field(default_factory=dict)
    #: Scan-then-decode only: decoded vs scanned, the control sample and the miss rate.
    screening: ScreeningReport | None = None
    #: The run's decode window (None: every decode ran to eos or the budget) and the ok results
    #: whose decode stopped at it (what they count in: module docstring).
    decode_window: int | None = None
    window_cut: int = 0


class TraceRef(StoredModel):
    id: str
    external_id: str | None


class LiftReport(StoredModel):
    """EAR(b) - EAR(a) paired by trace, on the traces where both results are ok.

    `fixed`: exact in b only; `broke`: exact in a only (agreeing at baseline, diverging with the
    intervention). The listed traces are the first `len(...)` of each, by trace; `*_more` says
    whether there are more than listed."""

    run_a: str
    comparison_a: int
    run_b: str
    comparison_b: int
    label_a: str
    label_b: str
    n: int
    ear_a: float | None
    ear_b: float | None
    lift: float | None
    low: float | None
    high: float | None
    confidence: float
    resamples: int
    seed: int
    fixed: int
    broke: int
    mcnemar_p: float
    fixed_traces: list[TraceRef]
    broke_traces: list[TraceRef]
    fixed_more: bool
    broke_more: bool


class FlipsRead(StoredModel):
    """Correctness flips between two arms on the traces both answered: gained (wrong at
    baseline, right treated), lost (right at baseline, wrong treated)."""

    gained: int
    lost: int
    n: int
    flip_rate: float | None


class ArmAccuracy(StoredModel):
    arm: ArmKey
    label: str
    accuracy: ProportionRead


class AccuracyPair(StoredModel):
    baseline: ArmKey
    treated: ArmKey
    label_baseline: str
    label_treated: str
    flips: FlipsRead
    #: Paired non-inferiority of accuracy(treated) - accuracy(baseline) at `margin` (its
    #: interval the (1 - 2 alpha) one, 90% at the default alpha); None: no common trace.
    tost: TostResult | None


class AccuracyReport(StoredModel):
    """Task accuracy per arm against the traces' reference answers (answers extracted by the
    named extractor), flips and non-inferiority of every arm against the first."""

    extractors: list[str]
    n_traces: int
    arms: list[ArmAccuracy]
    pairs: list[AccuracyPair]
    margin: float
    alpha: float


class EngineReproduction(StoredModel):
    """The run's traces replayed here in their own logged configuration before any comparison
    (reproduce before compare): the share that reproduced token for token. A trace that does
    not can diverge in a format comparison because of the stack (kernels, attention, versions,
    a nondeterministic kernel of the logging stack), not the format: its comparisons with the
    logged tokens are judged against this replay instead (`ComparisonReport.baselines`)."""

    #: The comparison that is the check (logged vs self).
    comparison: int
    #: Traces of the run per logging engine.
    engines: dict[str, int]
    #: Traces of the run.
    n: int
    #: Traces not found diverging from their logged tokens among those whose self-replay
    #: finished ok (so compared with their logged tokens), with a Wilson interval: token for
    #: token where decoded, and by the scan at every step where only scanned (`scanned_only`).
    reproduced: ProportionRead
    #: The first traces the engine did not reproduce (by trace), and whether there are more.
    not_reproduced: list[TraceRef]
    not_reproduced_more: bool
    #: Of `reproduced`'s traces, those whose check was only scanned (scan-then-decode: its
    #: scan agreed with every logged token, and it was not in a sample that is decoded).
    scanned_only: int = 0


class RunStatistics(StoredModel):
    """A run's statistics: each comparison, each treatment's lift over comparison 0, and task
    accuracy at the default TOST margin where traces carry reference answers."""

    run_id: str
    comparisons: list[ComparisonReport]
    lifts: list[LiftReport]
    accuracy: AccuracyReport | None
    #: The engine-reproduction check, in runs over traces logged by another engine.
    engine_reproduction: EngineReproduction | None = None


# -- builders ----------------------------------------------------------------------------------


_prop = ProportionRead.of


def _finite(values: Sequence[float | int | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _t_star_histogram(values: Sequence[int | None]) -> Histogram | None:
    xs = _finite(values)
    if not xs:
        return None
    width = max(1, math.ceil((max(xs) + 1) / T_STAR_BINS))
    n_bins = math.ceil((max(xs) + 1) / width)
    return histogram(xs, [float(i * width) for i in range(n_bins + 1)])


def log_axis(groups: Iterable[Iterable[float]]) -> tuple[int, int] | None:
    """One log axis (whole decades) for several margin histograms, so they compare by eye:
    every finite positive value of every group falls inside it."""
    positive = [float(v) for g in groups for v in g if v > 0 and math.isfinite(v)]
    if not positive:
        return None
    low, high = min(positive), max(positive)
    lo = math.floor(math.log10(low))
    hi = max(math.ceil(math.log10(high)), lo + 1)
    while 10.0**lo > low:  # log10 rounding at the ends
        lo -= 1
    while 10.0**hi < high:
        hi += 1
    return lo, hi


def margin_histogram(values: Iterable[float], axis: tuple[int, int] | None) -> LogHistogram | None:
    """The finite non-negative `values` on `axis` (`log_axis`); zeros counted apart."""
    xs = [float(v) for v in values if math.isfinite(v) and v >= 0]
    if not xs:
        return None
    if axis is None:  # only zeros: no bins, the zero count alone
        return LogHistogram(edges=(), counts=(), zeros=len(xs), below=0, above=0)
    return log_histogram(xs, decades=axis, bins_per_decade=MARGIN_BINS_PER_DECADE)


@dataclass(frozen=True)
class _Margins:
    a: list[float]
    b: list[float]
    a_ulps: list[float]
    b_ulps: list[float]


def _margins(figures: Sequence[ResultFigures]) -> _Margins:
    diverged = [f for f in figures if f.diverged]
    return _Margins(
        a=_finite([f.margin_a for f in diverged]),
        b=_finite([f.margin_b for f in diverged]),
        a_ulps=_finite([f.margin_a_ulps for f in diverged]),
        b_ulps=_finite([f.margin_b_ulps for f in diverged]),
    )


class _Rate(NamedTuple):
    """A proportion as the estimates read it: its estimate (None: unknown) and interval."""

    estimate: float | None
    low: float
    high: float


def _rate(p: ProportionRead, stratum: int) -> _Rate:
    """What the estimates carry of a proportion measured on a sample of a `stratum` of traces:
    its Wilson estimate and interval; nothing measured, the widest; an empty stratum adds
    nothing whatever its rate (0)."""
    if p.n:
        return _Rate(p.estimate, p.low, p.high)
    return _Rate(None, 0.0, 1.0) if stratum else _Rate(0.0, 0.0, 0.0)


def _estimate(
    f: Callable[[float, float, float], float],
    rates: tuple[_Rate, _Rate, _Rate],
    up: tuple[bool, bool, bool],
) -> EstimateRead:
    """`f(q, p, r)`, monotone in each (increasing where `up`), at the estimates and, for each
    end of the interval, at the ends of the intervals that make it least and most: the box of
    the 95% intervals, so it covers the truth whenever all of them do."""

    def at(low_end: bool) -> float:
        q, p, r = (x.low if u == low_end else x.high for x, u in zip(rates, up, strict=True))
        return f(q, p, r)

    qe, pe, re = (x.estimate for x in rates)
    estimate = f(qe, pe, re) if qe is not None and pe is not None and re is not None else None
    return EstimateRead(estimate=estimate, low=at(True), high=at(False))


def screening_report(c: ComparisonInput) -> ScreeningReport | None:
    """The screening block of a scan-then-decode comparison (None when no result has a
    screen: another mode)."""
    ok = [f for f in c.figures if f.ok and f.screen is not None]
    if not ok:
        return None
    mismatch = [f for f in ok if f.screen == "flagged"]  # decoded from s: the flagged sample
    kept = sum(1 for f in ok if f.screen == "flagged_scanned")  # not decoded: the scan's result
    near = [f for f in ok if f.screen == "near_tie"]  # decoded in full: the flagged sample
    near_kept = sum(1 for f in ok if f.screen == "near_tie_scanned")  # only scanned
    control = [f for f in ok if f.screen == "control"]
    # Both rules flag: the control sample is drawn from the traces neither flags.
    flagged = mismatch + near
    unflagged = len(ok) - len(flagged) - kept - near_kept
    missed = [f for f in control if f.exact_match is False]
    flagged_div = sum(1 for f in flagged if f.exact_match is False)
    flagged_exact = len(flagged) - flagged_div
    mismatch_div = sum(1 for f in mismatch if f.exact_match is False)
    near_div = flagged_div - mismatch_div
    rate = _prop(len(missed), len(control))
    false_flag_rate = _prop(len(mismatch) - mismatch_div, len(mismatch))
    near_rate = _prop(near_div, len(near))
    rates = (_rate(false_flag_rate, kept), _rate(rate, unflagged), _rate(near_rate, near_kept))

    # q: the false-flag rate (a kept flagged trace is exact with probability q); p: the
    # unflagged divergence rate; r: the near-tie divergence rate (a near-tie trace only
    # scanned diverges with probability r, a flagged divergence). Each is monotone in all.
    def misses(_q: float, p: float, _r: float) -> float:
        return unflagged * p

    def divergences(q: float, p: float, r: float) -> float:
        return flagged_div + kept * (1.0 - q) + near_kept * r + unflagged * p

    def miss_rate(q: float, p: float, r: float) -> float:
        total = divergences(q, p, r)
        return unflagged * p / total if total else 0.0

    def ear(q: float, p: float, r: float) -> float:
        exact = flagged_exact + kept * q + near_kept * (1.0 - r) + unflagged * (1.0 - p)
        return exact / len(ok)

    est_misses = _estimate(misses, rates, (True, True, True))
    est_rate = _estimate(miss_rate, rates, (True, True, False))
    est_ear = _estimate(ear, rates, (True, False, False))
    qe, pe, re = (x.estimate for x in rates)
    # 0 / 0 at the estimate: no divergence seen or estimated at all.
    if qe is not None and pe is not None and re is not None and divergences(qe, pe, re) == 0:
        est_rate = EstimateRead(estimate=None, low=est_rate.low, high=est_rate.high)
    return ScreeningReport(
        scanned=len(ok),
        flagged=len(mismatch) + kept,
        flagged_decoded=len(mismatch),
        flagged_scanned=kept,
        flagged_fraction=c.flagged_fraction,
        near_tie=len(near) + near_kept,
        near_tie_decoded=len(near),
        near_tie_scanned=near_kept,
        near_tie_diverged=near_div,
        near_tie_divergence=near_rate,
        scan_flag_ulps=c.scan_flag_ulps,
        decoded=len(flagged) + len(control),
        decoded_by_reason={
            "mismatch": len(mismatch),
            "near_tie": len(near),
            "control": len(control),
        },
        scanned_only=unflagged - len(control),
        control=len(control),
        control_fraction=c.control_fraction,
        control_seed=c.control_seed,
        control_diverged=len(missed),
        misses_by_category={k: sum(1 for f in missed if f.category == k) for k in CATEGORIES[1:]},
        false_flags=len(mismatch) - mismatch_div,
        flagged_diverged=mismatch_div,
        false_flag_rate=false_flag_rate,
        unflagged_divergence=rate,
        estimated_misses=est_misses,
        miss_rate=est_rate,
        ear=est_ear,
    )


def comparison_report(
    c: ComparisonInput,
    *,
    abs_axis: tuple[int, int] | None,
    ulps_axis: tuple[int, int] | None,
) -> ComparisonReport:
    """One comparison's statistics; the two log axes are shared by a run's comparisons."""
    figures = c.figures
    ok = [f for f in figures if f.ok]
    # What EAR and the categories count: results a replay established (every ok one, but the
    # traces a scan-then-decode run only scanned).
    established = [f for f in ok if f.exact_match is not None]
    diverged = [f for f in established if not f.exact_match]
    steps = sum(int(f.n_steps or 0) for f in ok)
    triggers = sum(int(f.gate_triggers or 0) for f in ok)
    gap_steps = sum(int(f.n_steps or 0) for f in ok if f.mean_gap is not None)
    gap_sum = sum(float(f.mean_gap) * int(f.n_steps or 0) for f in ok if f.mean_gap is not None)
    arm_a = [f for f in ok if f.n_steps_a is not None]
    steps_a = sum(int(f.n_steps_a or 0) for f in arm_a) if arm_a else None
    triggers_a = sum(int(f.gate_triggers_a or 0) for f in arm_a) if arm_a else None
    # A scan's "answers" are the logged text's twice; a window-cut result's text is a prefix.
    answered = [f for f in established if f.answer_extractor is not None and not f.window_cut]
    if c.mode == "scan":
        answered = []
    agree = sum(1 for f in answered if f.answer_a == f.answer_b)
    neither = sum(1 for f in answered if f.answer_a is None and f.answer_b is None)
    categories = {k: sum(1 for f in established if f.category == k) for k in CATEGORIES}
    m = _margins(figures)
    cut = sum(1 for f in ok if f.window_cut)
    sar_note = SAR_NOTES.get(c.mode)
    judged_against = Counter(f.baseline or "logged" for f in ok)
    if cut:
        why = (
            f"{counted(cut, 'result')} decoded only to t* + {c.decode_window} "
            "not counted (a prefix of the replay text)"
        )
        sar_note = f"{sar_note}; {why}" if sar_note else why
    return ComparisonReport(
        index=c.index,
        a=c.a,
        b=c.b,
        label=c.label,
        treatment=c.treatment,
        mode=c.mode,
        n=len(figures),
        ok=len(ok),
        failed=len(figures) - len(ok),
        ear=_prop(sum(1 for f in established if f.exact_match), len(established)),
        sar=_prop(agree, len(answered)) if answered else None,
        sar_note=sar_note,
        sar_neither_answered=neither,
        steps=steps,
        gate_triggers=triggers,
        trigger_rate=triggers / steps if steps else None,
        mean_gap=gap_sum / gap_steps if gap_steps else None,
        steps_a=steps_a,
        gate_triggers_a=triggers_a,
        trigger_rate_a=triggers_a / steps_a if steps_a and triggers_a is not None else None,
        categories={k: _prop(v, len(established)) for k, v in categories.items()},
        first_divergence_step=finite_distribution([f.first_divergence_step for f in diverged]),
        t_star_histogram=_t_star_histogram([f.first_divergence_step for f in diverged]),
        margin_at_divergence=MarginReport(
            a=finite_distribution(m.a),
            a_ulps=finite_distribution(m.a_ulps),
            b=finite_distribution(m.b),
            b_ulps=finite_distribution(m.b_ulps),
            ties=sum(1 for f in diverged if f.margin_a == 0.0 or f.margin_b == 0.0),
            histogram_a=margin_histogram(m.a, abs_axis),
            histogram_b=margin_histogram(m.b, abs_axis),
            histogram_a_ulps=margin_histogram(m.a_ulps, ulps_axis),
            histogram_b_ulps=margin_histogram(m.b_ulps, ulps_axis),
        ),
        length_difference=finite_distribution(
            [f.length_difference for f in diverged if not f.window_cut]
        ),
        screening=screening_report(c),
        decode_window=c.decode_window,
        window_cut=cut,
        baselines={b: judged_against[b] for b in BASELINES if judged_against[b]},
    )


class PairedOutcome(NamedTuple):
    """One trace of a lift: whether each side's result was an exact match (both ok)."""

    trace_id: int
    exact_a: bool
    exact_b: bool


@dataclass(frozen=True)
class LiftSides:
    """What names the two sides of a lift."""

    run_a: str
    comparison_a: int
    label_a: str
    run_b: str
    comparison_b: int
    label_b: str


def flipped_ids(
    pairs: Sequence[PairedOutcome], list_limit: int = DEFAULT_LIST_LIMIT
) -> tuple[list[int], list[int]]:
    """The first `list_limit` traces fixed (exact in b only) and broke (exact in a only), by
    trace id: the ones a lift lists. `pairs` in trace id order."""
    fixed = [p.trace_id for p in pairs if p.exact_b and not p.exact_a][:list_limit]
    broke = [p.trace_id for p in pairs if p.exact_a and not p.exact_b][:list_limit]
    return fixed, broke


def lift_from_pairs(
    pairs: Sequence[PairedOutcome],
    sides: LiftSides,
    refs: Mapping[int, TraceRef],
    *,
    list_limit: int = DEFAULT_LIST_LIMIT,
) -> LiftReport:
    """EAR(b) - EAR(a) over `pairs` (the traces where both results are ok, in trace id order):
    seeded paired bootstrap interval, exact McNemar test, and the fixed/broke traces (`refs`
    names at least those of `flipped_ids`)."""
    ea = [p.exact_a for p in pairs]
    eb = [p.exact_b for p in pairs]
    n = len(pairs)
    lift = low = high = None
    n_fixed = n_broke = 0
    if n:
        res = paired_bootstrap_lift(ea, eb, resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED)
        lift, low, high, n_fixed, n_broke = res.lift, res.low, res.high, res.fixed, res.broke
    fixed, broke = flipped_ids(pairs, list_limit)
    return LiftReport(
        run_a=sides.run_a,
        comparison_a=sides.comparison_a,
        run_b=sides.run_b,
        comparison_b=sides.comparison_b,
        label_a=sides.label_a,
        label_b=sides.label_b,
        n=n,
        ear_a=sum(ea) / n if n else None,
        ear_b=sum(eb) / n if n else None,
        lift=lift,
        low=low,
        high=high,
        confidence=0.95,
        resamples=BOOTSTRAP_RESAMPLES,
        seed=BOOTSTRAP_SEED,
        fixed=n_fixed,
        broke=n_broke,
        mcnemar_p=mcnemar_exact(n_broke, n_fixed).p_value,
        fixed_traces=[refs[t] for t in fixed],
        broke_traces=[refs[t] for t in broke],
        fixed_more=n_fixed > list_limit,
        broke_more=n_broke > list_limit,
    )


def lift_report(
    run_id: str,
    base: ComparisonInput,
    treated: ComparisonInput,
    *,
    list_limit: int = DEFAULT_LIST_LIMIT,
) -> LiftReport:
    """EAR lift of `treated` over `base` (two comparisons of run `run_id`), paired by trace on
    the traces where both are established (ok, and decoded in scan-then-decode)."""
    a_by = {f.trace_id: f for f in base.figures if f.established}
    b_by = {f.trace_id: f for f in treated.figures if f.established}
    pairs = [
        PairedOutcome(t, bool(a_by[t].exact_match), bool(b_by[t].exact_match))
        for t in sorted(a_by.keys() & b_by.keys())
    ]
    refs = {t: TraceRef(id=f.trace_public_id, external_id=f.external_id) for t, f in b_by.items()}
    sides = LiftSides(run_id, base.index, base.label, run_id, treated.index, treated.label)
    return lift_from_pairs(pairs, sides, refs, list_limit=list_limit)


def accuracy_report(
    answers: Sequence[AnswerFigures],
    comparisons: Sequence[ComparisonInput],
    *,
    extract: Callable[[str], Callable[[str], str | None] | None],
    arm_label: Callable[[ArmKey], str],
    margin: float = DEFAULT_TOST_MARGIN,
    alpha: float = DEFAULT_TOST_ALPHA,
) -> AccuracyReport | None:
    """Task accuracy per arm against the reference answers, correctness flips and the TOST
    non-inferiority test (at `margin`, level `alpha`) of every arm against the first; None when
    no result has an answer to check. `extract(name)` is the extractor called `name` (None when
    this process does not know it: those answers are not counted)."""
    by_index = {c.index: c for c in comparisons}
    correct: dict[ArmKey, dict[int, bool]] = {}
    references: dict[tuple[str, int], str | None] = {}
    extractors: set[str] = set()
    for row in answers:
        fn = extract(row.extractor)
        if fn is None:
            continue
        key = (row.extractor, row.trace_id)
        if key not in references:
            references[key] = fn(row.reference_answer)
        ref = references[key]
        if ref is None:
            continue  # the reference itself has no extractable answer
        extractors.add(row.extractor)
        c = by_index[row.comparison]
        for arm, answer in ((c.a, row.answer_a), (c.b, row.answer_b)):
            correct.setdefault(arm, {}).setdefault(row.trace_id, answer == ref)
    if not correct:
        return None
    order: list[ArmKey] = ["logged"] if "logged" in correct else []
    order += sorted(k for k in correct if isinstance(k, int))
    arms = [
        ArmAccuracy(
            arm=k, label=arm_label(k), accuracy=_prop(sum(correct[k].values()), len(correct[k]))
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
            tost = tost_noninferiority(base, treat, margin=margin, alpha=alpha)
            flips_read = FlipsRead(
                gained=flips.gained, lost=flips.lost, n=flips.n, flip_rate=flips.flip_rate
            )
        else:
            flips_read = FlipsRead(gained=0, lost=0, n=0, flip_rate=None)
        pairs.append(
            AccuracyPair(
                baseline=base_key,
                treated=k,
                label_baseline=arm_label(base_key),
                label_treated=arm_label(k),
                flips=flips_read,
                tost=tost,
            )
        )
    n_traces = len(set().union(*(v.keys() for v in correct.values())))
    return AccuracyReport(
        extractors=sorted(extractors),
        n_traces=n_traces,
        arms=arms,
        pairs=pairs,
        margin=margin,
        alpha=alpha,
    )


def engine_reproduction(
    check: EngineCheckInput,
    comparisons: Sequence[ComparisonInput],
    *,
    list_limit: int = DEFAULT_LIST_LIMIT,
) -> EngineReproduction:
    """The check's figures: how many of the run's traces reproduced, by logging engine, and
    the first that did not."""
    by_index = {c.index: c for c in comparisons}
    figures = by_index[check.comparison].figures if check.comparison in by_index else []
    checked = [f for f in figures if f.trace_id in check.engines and f.ok]
    # A check only scanned (exact match unknown) was not found diverging: its trace is
    # compared with its logged tokens (`replay_traces`), so it is not listed as not reproduced.
    missed = sorted((f for f in checked if f.diverged), key=lambda f: f.trace_id)
    return EngineReproduction(
        comparison=check.comparison,
        engines=dict(sorted(Counter(check.engines.values()).items())),
        n=len(check.engines),
        reproduced=_prop(len(checked) - len(missed), len(checked)),
        not_reproduced=[
            TraceRef(id=f.trace_public_id, external_id=f.external_id) for f in missed[:list_limit]
        ],
        not_reproduced_more=len(missed) > list_limit,
        scanned_only=sum(1 for f in checked if not f.established),
    )


def run_statistics(
    run_id: str,
    comparisons: Sequence[ComparisonInput],
    *,
    accuracy: AccuracyReport | None = None,
    engine_check: EngineCheckInput | None = None,
    list_limit: int = DEFAULT_LIST_LIMIT,
) -> RunStatistics:
    """The statistics of a run: every comparison (margin histograms on one shared axis), the
    lift of every treatment over comparison 0 and, with `engine_check`, the reproduction
    rate of the run's traces in their own logged configuration."""
    margins = [_margins(c.figures) for c in comparisons]
    abs_axis = log_axis(g for m in margins for g in (m.a, m.b))
    ulps_axis = log_axis(g for m in margins for g in (m.a_ulps, m.b_ulps))
    reports = [comparison_report(c, abs_axis=abs_axis, ulps_axis=ulps_axis) for c in comparisons]
    reproduction = None
    if engine_check is not None:
        reproduction = engine_reproduction(engine_check, comparisons, list_limit=list_limit)
    lifts = [
        lift_report(run_id, comparisons[0], c, list_limit=list_limit)
        for c in comparisons[1:]
        if c.treatment
    ]
    return RunStatistics(
        run_id=run_id,
        comparisons=reports,
        lifts=lifts,
        accuracy=accuracy,
        engine_reproduction=reproduction,
    )
