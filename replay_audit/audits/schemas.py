"""The audit-schedule contract: `/v1/audits/schedules` and what it returns (a schedule's JSON,
with an example: docs/audits.md, "A schedule").

`replay` takes ReplayCreate's fields but the trace selection (`trace_ids`/`filter`, which the
schedule draws itself) and `idempotency_key` (the schedule's: `schedule:<id>:<due>`). Put the
baseline target first: the trend's EAR and C lift read comparison order. `verify` (optional)
takes VerificationCreate's fields but the filter (the run's sample, by trace id) and
`idempotency_key` (the schedule's, as the replay run's).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    AnyHttpUrl,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from replay_audit.audits.metrics import CLift, ComparisonMetrics, Flag, VerificationMetrics
from replay_audit.audits.sampling import Policy
from replay_audit.audits.schedule import NIGHTLY, validate_cron
from replay_audit.audits.webhook import ErrorClass
from replay_audit.exceptions import FieldError
from replay_audit.formats import (
    CONTROL_FRACTION,
    CONTROL_SEED,
    DECODE_WINDOW,
    FLAGGED_FRACTION,
    SCAN_FLAG_ULPS,
    TOP_K,
    BodyDType,
    Compare,
    CompareWith,
    Device,
    Mode,
)
from replay_audit.input import InputModel, Lax, option_field
from replay_audit.output import OutputModel
from replay_audit.replays.schemas import (
    MAX_REPLAY_TRACES,
    PAIRS_RULE,
    PAIRWISE_RULE,
    TARGETS_RULE,
    ReplayCreate,
    TargetIndex,
    TargetSpec,
)
from replay_audit.traces.schemas import Name, Tag
from replay_audit.traces.selection import TraceSelection
from replay_audit.verifications.schemas import (
    MAX_VERIFICATION_TRACES,
    GroupBy,
    VerificationCreate,
    VerificationFilter,
)

ScheduleStatus = Literal["active", "paused"]
AuditRunStatus = Literal["running", "done", "no_traces", "failed"]
Trigger = Literal["scheduled", "manual", "catch_up"]
AlertStatus = Literal["pending", "delivered", "failed"]

#: Longest trace window a schedule may look back over.
MAX_WINDOW_HOURS = 24 * 90
#: Most runs one catch-up request starts.
MAX_CATCH_UP = 100


class Selection(InputModel):
    """Which traces are candidates: greedy ones carrying all of `tags`, of the model and
    configuration if given, created in the `window_hours` before the due time."""

    tags: list[Tag] = Field(default_factory=list, max_length=16)
    model_name: str | None = Field(default=None, max_length=200)
    weights_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    #: A numerical configuration's public id.
    config_id: str | None = Field(default=None, max_length=40)
    dtype: BodyDType | None = None
    window_hours: float = Field(default=24.0, gt=0, le=MAX_WINDOW_HOURS, allow_inf_nan=False)

    def window(self, due_at: datetime) -> tuple[datetime, datetime]:
        """[start, end) of the traces a run due at `due_at` draws from."""
        return due_at - timedelta(hours=self.window_hours), due_at

    def to_selection(self, start: datetime, end: datetime) -> TraceSelection:
        """The candidates of a run whose window is [start, end). An empty string selects
        nothing less: it means "any", as it always has here."""
        return TraceSelection(
            model_name=self.model_name or None,
            weights_sha256=self.weights_sha256 or None,
            config_id=self.config_id or None,
            dtype=self.dtype,
            tags=tuple(self.tags),
            created_after=start,
            created_before=end,
            greedy=True,
        )


class ScheduleReplay(InputModel):
    """What each run replays: ReplayCreate's fields without the trace selection (and its
    rules: at least one target or `compare_with: "self"`, ...)."""

    model_config = ConfigDict(
        json_schema_extra={"allOf": [TARGETS_RULE, PAIRS_RULE, PAIRWISE_RULE]}
    )

    targets: list[TargetSpec] = Field(default_factory=list)
    #: None: each run by the large-run rule on the traces it samples (scan-then-decode from
    #: `REPLAY_AUDIT_LARGE_RUN_TRACES` sampled traces up, decode below).
    mode: Mode | None = None
    control_fraction: float = option_field(CONTROL_FRACTION)
    control_seed: int = option_field(CONTROL_SEED)
    #: ReplayCreate's: the share of flagged traces decoded (None: all, but a run
    #: large by the large-run rule gets `REPLAY_AUDIT_LARGE_RUN_FLAGGED_FRACTION`).
    flagged_fraction: float | None = option_field(FLAGGED_FRACTION, default=None)
    #: ReplayCreate's: the near-tie flag of scan-then-decode runs (None: the deployment's).
    scan_flag_ulps: float | None = option_field(SCAN_FLAG_ULPS, default=None)
    #: ReplayCreate's: decodes stop this many tokens after t* (None: to eos or the budget).
    decode_window: int | None = option_field(DECODE_WINDOW, default=None)
    compare: Compare = "logged"
    pairs: list[Annotated[tuple[TargetIndex, TargetIndex], Lax]] | None = None
    compare_with: CompareWith | None = None
    top_k: int = option_field(TOP_K)

    @model_validator(mode="after")
    def _check(self) -> ScheduleReplay:
        self.to_request(["check"], "check")  # ReplayCreate's own rules, at creation time
        return self

    def to_request(
        self, trace_ids: list[str], idempotency_key: str, name: str | None = None
    ) -> ReplayCreate:
        """The replay request of one run (named `name`)."""
        return ReplayCreate(
            trace_ids=trace_ids, idempotency_key=idempotency_key, name=name, **self.model_dump()
        )


class ScheduleVerify(InputModel):
    """Verify each run's sample too (docs/verify.md): VerificationCreate's fields but the
    filter and the idempotency key, which are the run's."""

    #: The groups a verdict is given to (and a flag raised for): the traces' tag sets, logging
    #: engines or configurations, or all of them together; each split by its claimed
    #: configuration, as a verification always is.
    group_by: GroupBy = "tag"
    false_alarm_rate: float = Field(default=0.01, ge=1e-4, le=0.5, allow_inf_nan=False)
    #: Where the scan runs (None: the deployment's default queue).
    device: Device | None = None

    def to_request(self, trace_ids: list[str], idempotency_key: str) -> VerificationCreate:
        """The verification of one run's sample."""
        return VerificationCreate(
            filter=VerificationFilter(trace_ids=trace_ids),
            idempotency_key=idempotency_key,
            **self.model_dump(),
        )


def check_verified_sample(sample_size: int | None, verify: ScheduleVerify | None) -> None:
    """A schedule that verifies samples at most MAX_VERIFICATION_TRACES traces (a verification's
    limit)."""
    if verify is not None and sample_size is not None and sample_size > MAX_VERIFICATION_TRACES:
        raise FieldError(
            f"sample_size: a schedule that verifies samples at most {MAX_VERIFICATION_TRACES} "
            "traces (a verification's limit)",
            field="sample_size",
        )


_HTTP_URL: TypeAdapter[AnyHttpUrl] = TypeAdapter(AnyHttpUrl)


def _http_url(value: str) -> str:
    # Checked as an http(s) URL, stored as sent: its length is the length the client sent
    # (a normalised URL can be longer than the 2,000 characters the column holds).
    try:
        _HTTP_URL.validate_python(value)
    except ValidationError:
        raise ValueError("must be an http(s) URL") from None
    return value


#: An http(s) URL of at most 2,000 characters, kept as sent.
WebhookUrl = Annotated[
    str,
    StringConstraints(min_length=1, max_length=2000, pattern=r"^[hH][tT][tT][pP][sS]?://"),
    AfterValidator(_http_url),
    WithJsonSchema(
        {
            "type": "string",
            "format": "uri",
            "minLength": 1,
            "maxLength": 2000,
            "pattern": "^[hH][tT][tT][pP][sS]?://",
        }
    ),
]


def _cron(value: str) -> str:
    try:
        return validate_cron(value)
    except FieldError as e:
        raise ValueError(e.message) from None


class ScheduleCreate(InputModel):
    name: Name
    cron: str = NIGHTLY
    selection: Selection = Selection()
    sample_size: int = Field(default=100, ge=1, le=MAX_REPLAY_TRACES)
    policy: Policy = "uniform"
    seed: int = Field(default=0, ge=0, lt=2**62)
    replay: ScheduleReplay
    #: Flag a run whose EAR falls more than this many percentage points below the trailing
    #: 7-run mean of the same comparison.
    ear_drop_points: float = Field(default=5.0, gt=0, le=100, allow_inf_nan=False)
    #: Also verify each run's sample; a group that turns inconsistent is flagged.
    verify: ScheduleVerify | None = None
    webhook_url: WebhookUrl | None = None
    status: ScheduleStatus = "active"

    _check_cron = field_validator("cron")(_cron)

    @model_validator(mode="after")
    def _verified_sample(self) -> ScheduleCreate:
        try:
            check_verified_sample(self.sample_size, self.verify)
        except FieldError as e:
            raise ValueError(e.message) from None
        return self


class ScheduleUpdate(InputModel):
    """PATCH: only the fields sent change. Pausing stops the scheduler; resuming starts afresh
    (due times while paused are neither run nor counted as missed)."""

    name: Name | None = None
    status: ScheduleStatus | None = None
    sample_size: int | None = Field(default=None, ge=1, le=MAX_REPLAY_TRACES)
    ear_drop_points: float | None = Field(default=None, gt=0, le=100, allow_inf_nan=False)
    #: null removes the webhook (and its secret).
    webhook_url: WebhookUrl | None = None
    #: true: a new signing secret replaces the webhook's secret (shown in this answer only);
    #: a 422 when the schedule has no webhook (stored, or `webhook_url` in this request).
    rotate_webhook_secret: bool = False


class AuditRunRead(OutputModel):
    id: str
    schedule_id: str
    due_at: datetime
    trigger: Trigger
    status: AuditRunStatus
    replay_run_id: str | None
    replay_status: str | None
    #: The run's verification (a schedule with `verify`), and its status.
    verification_id: str | None = None
    verification_status: str | None = None
    window_start: datetime
    window_end: datetime
    n_candidates: int
    n_sampled: int
    flags: list[Flag]
    error: str | None
    created_at: datetime
    evaluated_at: datetime | None


class ScheduleRead(OutputModel):
    id: str
    project: str
    name: str
    cron: str
    status: ScheduleStatus
    selection: Selection
    sample_size: int
    policy: Policy
    seed: int
    replay: ScheduleReplay
    ear_drop_points: float
    verify: ScheduleVerify | None
    #: Shown whole to admins; others see only its scheme and host (a webhook URL is often a
    #: secret).
    webhook_url: str | None
    active_since: datetime
    created_at: datetime
    updated_at: datetime
    #: None while paused.
    next_due_at: datetime | None
    last_run: AuditRunRead | None
    #: Due times since active_since (or the last MISSED_LOOKBACK) with no run.
    missed: int


class ScheduleWritten(ScheduleRead):
    """A schedule as created or changed: with `webhook_secret` when this request made one (at
    creation with a webhook, on rotation, or when a webhook is added), shown this once; null
    otherwise. Deliveries are signed with it (docs/audits.md, "Verifying a delivery")."""

    webhook_secret: str | None = None


class ScheduleList(OutputModel):
    items: list[ScheduleRead]


class AuditRunCreated(OutputModel):
    run: AuditRunRead
    created: bool


class AuditRunList(OutputModel):
    items: list[AuditRunRead]


class CatchUpRequest(InputModel):
    #: Start at most this many of the missed runs, the newest first.
    limit: int = Field(default=MAX_CATCH_UP, ge=1, le=MAX_CATCH_UP)


class CatchUpResult(OutputModel):
    started: list[AuditRunRead]
    #: Missed due times left (beyond `limit`).
    remaining: int


class Missed(OutputModel):
    schedule_id: str
    #: Due times in [since, now - grace] with no run, oldest first.
    due_at: list[datetime]
    since: datetime
    truncated: bool


class TrendPoint(OutputModel):
    """One run of a schedule on the trend chart (null where the run has no such number)."""

    audit_run_id: str
    due_at: datetime
    date: str
    trigger: Trigger
    status: AuditRunStatus
    replay_run_id: str | None
    n_sampled: int
    ear: float | None
    ear_low: float | None
    ear_high: float | None
    c_lift: CLift | None
    trigger_rate: float | None
    categories: dict[str, int]
    self_agreement: float | None
    comparisons: list[ComparisonMetrics]
    #: The run's verification and its groups' verdicts (null: the schedule does not verify,
    #: or the run has not been evaluated).
    verification: VerificationMetrics | None = None
    flags: list[Flag]
    flagged: bool


class Trend(OutputModel):
    schedule_id: str
    points: list[TrendPoint]


class AttemptRead(OutputModel):
    """One delivery attempt: its answer's status code (null without an answer) and an error
    class (null when delivered); never what the receiver answered."""

    at: datetime | None
    ok: bool
    status_code: int | None
    error: ErrorClass | None


class AlertRead(OutputModel):
    id: str
    audit_run_id: str
    url: str
    status: AlertStatus
    attempts: int
    attempt_log: list[AttemptRead]
    #: The last attempt's error class.
    last_error: ErrorClass | None
    created_at: datetime
    delivered_at: datetime | None


class AlertList(OutputModel):
    items: list[AlertRead]
