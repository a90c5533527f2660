"""The typed trend point of an audit run and its drift flags: what `drift.run_metrics` and
`drift.detect_drift` build, what `audit_runs.metrics` and `audit_runs.flags` store (JSON, through
`db.types.ModelJSON`: `model_dump(mode="json")` in, `model_validate` out), and what the trend
endpoint, the schedule page and the webhook serve.

    ComparisonMetrics  one comparison of the run: its counts (n, exact, categories), EAR with its
                       Wilson interval, trigger rate
    CLift              the C comparison's lift over the baseline (paired)
    RunMetrics         the run's point: comparisons and the headline numbers
    DriftTest          the test a flag rests on: counts of the latest run and of the pooled
                       baseline runs, p-value and alpha
    Flag               one drift flag: kind, comparison (index and label), test, message

Rows written before these models (the same keys as plain dicts, flags with kind-specific
extra keys and no `test`) still read: every field added since has a default, unknown keys are
ignored, and a flag without a test says so (`test: null`).
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

#: Significance level of every drift rule's count test, i.e. its false-alarm rate
#: (REPLAY_AUDIT_DRIFT_ALPHA).
DEFAULT_ALPHA: Final = 0.01
#: Traces needed on each side (latest run, pooled baseline runs) before a count test may fire
#: (REPLAY_AUDIT_DRIFT_MIN_N).
DEFAULT_MIN_N: Final = 10

#: Flag kinds (docs/audits.md, "Trend and drift").
FlagKind = Literal["ear_drop", "self_disagreement", "new_category"]
#: The test a flag rests on:
#:   fisher_exact_less     one-sided Fisher exact test, the latest rate below the baseline's
#:   fisher_exact_greater  one-sided Fisher exact test, the latest rate above the baseline's
#:   deterministic         a self-replay must agree on every trace: one disagreement cannot
#:                         happen under H0 (a deterministic engine), p = 0
TestName = Literal["fisher_exact_less", "fisher_exact_greater", "deterministic"]


class _Stored(BaseModel):
    # Frozen like the report models; extra keys of older rows are ignored, not refused.
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class ComparisonMetrics(_Stored):
    """One comparison of a run, from its `ComparisonReport`."""

    index: int
    label: str = ""
    #: The `compare_with: "self"` comparison (JSON key `self`).
    is_self: bool = Field(default=False, alias="self")
    #: The replay arm's intervention kind (`none` for the self-replay).
    intervention: str = "none"
    #: Traces compared (`ok`); None in rows that did not record it.
    n: int | None = None
    failed: int = 0
    ear: float | None = None
    ear_low: float | None = None
    ear_high: float | None = None
    #: Traces that replayed token-identically (EAR's successes).
    exact: int | None = None
    trigger_rate: float | None = None
    #: Category -> traces (`agreed` included).
    categories: dict[str, int] = Field(default_factory=dict)


class CLift(_Stored):
    """EAR(C comparison) - EAR(baseline) on the same traces (`LiftReport`)."""

    lift: float | None = None
    low: float | None = None
    high: float | None = None
    n: int = 0
    fixed: int = 0
    broke: int = 0
    #: The C comparison's index.
    comparison: int | None = None


class RunMetrics(_Stored):
    """The trend point of one evaluated audit run (see `drift.run_metrics`)."""

    comparisons: list[ComparisonMetrics] = Field(default_factory=list)
    #: The baseline comparison's EAR and Wilson 95% interval.
    ear: float | None = None
    ear_low: float | None = None
    ear_high: float | None = None
    #: The baseline comparison's index (the first that is not the self-replay).
    baseline: int | None = None
    c_lift: CLift | None = None
    trigger_rate: float | None = None
    categories: dict[str, int] = Field(default_factory=dict)
    self_agreement: float | None = None

    def comparison(self, index: int) -> ComparisonMetrics | None:
        return next((c for c in self.comparisons if c.index == index), None)


class DriftTest(_Stored):
    """The evidence behind a flag: the latest run's counts against the pooled counts of the
    baseline runs (the previous runs the rule looks at), the test, its p-value and the
    significance level it was held to (its false-alarm rate)."""

    test: TestName
    #: Latest run: successes (traces that agreed, or that fell in the category) of n.
    latest_successes: int
    latest_n: int
    #: Pooled over `baseline_runs` previous runs (0 of 0 for the deterministic test).
    baseline_successes: int = 0
    baseline_n: int = 0
    baseline_runs: int = 0
    p_value: float
    alpha: float


class Flag(_Stored):
    """One drift flag of a run. `message` says why it fired, in words; `test` in numbers."""

    kind: FlagKind
    comparison: int
    #: The comparison's label (`fp16`, `FP16 + C`, `self (logged configuration)`).
    label: str = ""
    test: DriftTest | None = None
    #: new_category: the category.
    category: str | None = None
    #: ear_drop: baseline EAR minus latest EAR, percentage points, and the schedule's
    #: threshold it exceeded (`ear_drop_points`).
    drop_points: float | None = None
    threshold_points: float | None = None
    message: str = ""

    @property
    def reason(self) -> str:
        """The message, led by the comparison's label (or index, for old rows without one)
        unless the message already names it."""
        name = self.label or f"comparison {self.comparison}"
        return self.message if self.message.startswith(name) else f"{name}: {self.message}"
