"""What a report says: `GET /v1/replays/{id}/report` returns `RunReport`, the web UI renders
the same objects, so the page and the API can never show different numbers.

Every rate comes with its interval: proportions (EAR, SAR, category shares, task accuracy) with
their Wilson 95% interval, lifts with a seeded paired-bootstrap interval and the exact McNemar
p-value, non-inferiority with its TOST interval and p-value.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

#: An arm of a run: "logged" (the trace as logged) or a target index.
ArmKey = Literal["logged"] | int


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class ProportionRead(_Frozen):
    """successes / n with its Wilson interval; `estimate` is None when n == 0."""

    successes: int
    n: int
    estimate: float | None
    low: float
    high: float


class DistributionRead(_Frozen):
    n: int
    min: float
    median: float
    p90: float
    max: float
    mean: float


class HistogramRead(_Frozen):
    """counts[i] values in [edges[i], edges[i+1])."""

    edges: list[float]
    counts: list[int]


class LogHistogramRead(_Frozen):
    """A histogram on a log10 axis; exact zeros counted apart (a log axis cannot show them)."""

    edges: list[float]
    counts: list[int]
    zeros: int
    below: int
    above: int


class MarginReport(_Frozen):
    """The margin at t* of the divergent results, per arm, absolute and in ulps."""

    replay: DistributionRead | None
    replay_ulps: DistributionRead | None
    logged: DistributionRead | None
    logged_ulps: DistributionRead | None
    #: Divergences where either arm's margin at t* is exactly 0 (a tie in that format).
    ties: int
    histogram_replay: LogHistogramRead | None
    histogram_logged: LogHistogramRead | None
    histogram_replay_ulps: LogHistogramRead | None
    histogram_logged_ulps: LogHistogramRead | None


class ComparisonReport(_Frozen):
    """One comparison of the run (arm a vs arm b over the run's traces)."""

    index: int
    a: ArmKey
    b: ArmKey
    label: str
    n: int
    ok: int
    failed: int
    ear: ProportionRead
    sar: ProportionRead | None
    steps: int
    gate_triggers: int
    trigger_rate: float | None
    mean_gap: float | None
    #: Share of each category among the ok results, with Wilson intervals.
    categories: dict[str, ProportionRead]
    first_divergence_step: DistributionRead | None
    t_star_histogram: HistogramRead | None
    margin_at_divergence: MarginReport
    length_difference: DistributionRead | None


class TraceRef(_Frozen):
    id: str
    external_id: str | None


class LiftReport(_Frozen):
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


class FlipsRead(_Frozen):
    """Correctness flips between two arms on the traces both answered: gained (wrong at
    baseline, right treated), lost (right at baseline, wrong treated)."""

    gained: int
    lost: int
    n: int
    flip_rate: float | None


class TostRead(_Frozen):
    """Paired non-inferiority (TOST) of accuracy(treated) - accuracy(baseline) at `margin`."""

    diff: float
    low: float
    high: float
    p_value: float
    non_inferior: bool
    margin: float
    alpha: float
    confidence: float


class ArmAccuracy(_Frozen):
    arm: ArmKey
    label: str
    accuracy: ProportionRead


class AccuracyPair(_Frozen):
    baseline: ArmKey
    treated: ArmKey
    label_baseline: str
    label_treated: str
    flips: FlipsRead
    tost: TostRead | None


class AccuracyReport(_Frozen):
    """Task accuracy per arm against the traces' reference answers (answers extracted by the
    named extractor), flips and non-inferiority of every arm against the first."""

    extractors: list[str]
    n_traces: int
    arms: list[ArmAccuracy]
    pairs: list[AccuracyPair]
    margin: float
    alpha: float


class RunReport(_Frozen):
    """A run's statistics. `partial`: the run is not finished; numbers cover the results
    stored so far."""

    run_id: str
    status: str
    partial: bool
    n_traces: int
    n_results: int
    comparisons: list[ComparisonReport]
    #: Every comparison against comparison 0 (the baseline), as the stored aggregate has them.
    lifts: list[LiftReport]
    #: The pair asked for (`?a=&b=`), if any.
    pair: LiftReport | None
    accuracy: AccuracyReport | None


class RunComparisonReport(_Frozen):
    """Two runs side by side, and one comparison of each paired by trace."""

    run_a: RunReport
    run_b: RunReport
    pair: LiftReport
    common_traces: int
