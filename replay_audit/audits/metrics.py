"""The typed trend point of an audit run and its drift flags: what `drift.run_metrics` and
`drift.detect_drift` build, what `audit_runs.metrics` and `audit_runs.flags` store (JSON, through
`db.types.ModelJSON`), and what the trend endpoint, the schedule page and the webhook serve.

Rows written before these models (the same keys as plain dicts, flags with kind-specific
extra keys and no `test`) still read: every field added since has a default, unknown keys are
ignored, and a flag without a test says so (`test: null`).
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from replay_audit.stats.verification import Verdict

#: Significance level of every drift rule's count test, i.e. its false-alarm rate
#: (REPLAY_AUDIT_DRIFT_ALPHA).
DEFAULT_ALPHA: Final = 0.01
#: Traces needed on each side (latest run, pooled baseline runs) before a count test may fire
#: (REPLAY_AUDIT_DRIFT_MIN_N).
DEFAULT_MIN_N: Final = 10

#: Flag kinds (docs/audits.md, "Trend and drift" and "Verification"): the first three are a
#: comparison's, `group_inconsistent` a verified group's.
FlagKind = Literal["ear_drop", "self_disagreement", "new_category", "group_inconsistent"]
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


class GroupMetrics(_Stored):
    """One group's verdict in a run's verification (`verifications.domain.group_json`, typed):
    its score against the threshold of its null at its token count, and the false-alarm rate
    the threshold holds to."""

    #: The group: its tag set, engine or configuration (`group_by`), and its claim.
    group: str
    verdict: Verdict
    statistic: str | None = None
    score: float | None = None
    threshold: float | None = None
    false_alarm_rate: float | None = None
    tokens: int = 0
    traces: int = 0
    #: inconsistent: the score minus the null's mean; the benign variation nearest it.
    effect_size: float | None = None
    closest_benign: str | None = None
    #: insufficient: the tokens a decision needs, and how many more.
    tokens_needed: int | None = None
    more_tokens: int | None = None
    #: Traces counted but not verified: sampled, or not scanned.
    sampled: int = 0
    failed: int = 0


VerificationStatus = Literal["done", "failed"]


class VerificationMetrics(_Stored):
    """The run's verification once finished: its id (`/v1/verifications/{id}`), status, the
    overall verdict and each group's (`failed`: no verdicts, and why)."""

    #: None: the verification was deleted.
    id: str | None = None
    status: VerificationStatus
    verdict: Verdict | None = None
    groups: list[GroupMetrics] = Field(default_factory=list)
    error: str | None = None

    def group(self, name: str) -> GroupMetrics | None:
        return next((g for g in self.groups if g.group == name), None)


class RunMetrics(_Stored):
    """The trend point of one evaluated audit run (see `drift.run_metrics`), with its
    verification's verdicts when the schedule verifies."""

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
    verification: VerificationMetrics | None = None

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
    """One flag of a run. `message` says why it fired, in words; `test` (a comparison's flag)
    or `verdict` (a group's) in numbers."""

    kind: FlagKind
    #: The comparison's index; None for a group's flag.
    comparison: int | None = None
    #: The comparison's label (`fp16`, `FP16 + C`, `self (logged configuration)`), or the
    #: group's name.
    label: str = ""
    test: DriftTest | None = None
    #: group_inconsistent: the group, its verdict now (score, threshold, false-alarm rate,
    #: tokens, effect size, closest benign variation), and its verdict in the previous run that
    #: verified (None: absent from it, or no such run).
    group: str | None = None
    verdict: GroupMetrics | None = None
    previous_verdict: Verdict | None = None
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
        name = self.label or (
            f"group {self.group}" if self.group is not None else f"comparison {self.comparison}"
        )
        return self.message if self.message.startswith(name) else f"{name}: {self.message}"
