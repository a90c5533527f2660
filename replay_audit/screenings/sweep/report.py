"""The screening report's typed form (JSON, HTML, API and the stored row all read this).
Pure: pydantic for the typed output, as `stats/report.py`, whose types it reuses; the plan's
frozen `Platform` dataclass is the report's `platform` itself, its schema derived by pydantic."""

from __future__ import annotations

from replay_audit.json_value import JsonObject
from replay_audit.output import StoredModel
from replay_audit.screenings.sweep.plan import Platform
from replay_audit.stats.report import ComparisonReport, LiftReport
from replay_audit.stats.summary import Distribution, LogHistogram


class KnobValueResult(StoredModel):
    """One value of a knob against the reference. status: measured; not_available (the
    platform cannot run it: `reason`); failed (it should have run and did not: `reason`)."""

    label: str
    config: JsonObject
    status: str
    reason: str | None
    comparison: ComparisonReport | None
    #: Median Δh at t* over the divergent prompts (None: none diverged or not measured).
    median_dh_t_star: float | None
    environment: JsonObject | None
    #: The tensor-parallel degree that ran (the engine's environment; the configuration's
    #: where nothing ran).
    tp_degree: int = 1


class KnobResult(StoredModel):
    name: str
    title: str
    values: list[KnobValueResult]


class CategoryLift(StoredModel):
    """A category of the pair's divergent prompts (baseline), and what both-arms C did to it:
    `fixed` prompts agree exactly with C in both arms."""

    category: str
    n: int
    fixed: int


class HiddenGapRead(StoredModel):
    """Δh = ||h_A - h_B|| / ||h_A|| of the pair's divergent prompts: at t*, and at the gated
    steps along the shared prefix (steps s <= t* where either arm's gate fired). h comes from a
    from-scratch forward (no KV cache) over prompt ‖ y<t* in each arm, not from the decodes:
    the KV cache's own numerics are left out (docs/screening.md says why)."""

    prompts: int
    t_star: Distribution | None
    gated: Distribution | None
    gated_steps: int
    by_category: dict[str, Distribution | None]


class PairResult(StoredModel):
    """The head-vs-body analysis of the pair (BF16 vs FP16 by default)."""

    label: str
    baseline: ComparisonReport
    treated: ComparisonReport
    lift: LiftReport | None
    categories: list[CategoryLift]
    hidden_gap: HiddenGapRead


class TriggerDensityRead(StoredModel):
    """Per-prompt trigger density TD_i (share of prompt i's decoded steps whose margin is below
    τ) of one run, and CV(TD) = population standard deviation / mean over the prompts."""

    run: str
    label: str
    head_format: str
    per_prompt: list[float]
    mean: float | None
    std: float | None
    cv: float | None


class MarginDistributionRead(StoredModel):
    """Every decoded step's top-2 margin in one run (log histograms; exact ties apart)."""

    run: str
    label: str
    head_format: str
    steps: int
    ties: int
    tie_share: float | None
    histogram: LogHistogram | None
    histogram_ulps: LogHistogram | None
    distribution: Distribution | None


class TauCalibrationRead(StoredModel):
    """The flip margins (min of the two arms' margins at t*) of divergent comparisons whose arm
    B has lm_head format `format`, and the τ that covers `cover` of them: absolute and in ulps,
    each with the trigger rate it would cost on the runs of that format (pooled steps)."""

    format: str
    flips: int
    flip_margin: Distribution | None
    flip_margin_ulps: Distribution | None
    cover: float
    tau: float | None
    tau_ulps: float | None
    steps: int
    trigger_rate: float | None
    trigger_rate_ulps: float | None


class TierRead(StoredModel):
    """The paper's tier from the pair's both-arms C lift and its paired interval, and the
    recommended action, with the evidence and its uncertainty."""

    tier: int | None
    name: str
    lift: float | None
    low: float | None
    high: float | None
    n: int
    diverged: int
    evidence: str
    action: str
    caveats: list[str]


class ScreeningReport(StoredModel):
    model: str
    weights_sha256: str | None
    platform: Platform
    reference: JsonObject
    pair: list[JsonObject]
    tau: float
    tau_ulps: float | None
    max_new_tokens: int
    prompts: int
    prompt_ids: list[str]
    knobs: list[KnobResult]
    head_vs_body: PairResult
    trigger_density: list[TriggerDensityRead]
    #: The run CV(TD) is read from: the pair's arm A (the paper's single BF16 run).
    cv_td: float | None
    margins: list[MarginDistributionRead]
    tau_calibration: list[TauCalibrationRead]
    tier: TierRead
    environments: dict[str, JsonObject]
