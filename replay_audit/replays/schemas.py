"""The replay-run contract: `POST /v1/replays` and what `GET /v1/replays/{id}[/results]` return.

Request (add fields, keep these):

    {"trace_ids": [...] | "filter": {...},
     "targets": [{"dtype": "fp16", "lm_head_dtype": null, "attn_kernel": null,
                  "intervention": {"kind": "C", "tau": 1e-3}}],
     "mode": "decode"}

Comparisons. By default (`compare: "logged"`) each target is compared with the logged tokens:
comparison i is target i vs the trace. With `compare: "pairwise"` the targets are compared with
each other (the paper's both-arms protocol: the worker runs e.g. BF16 + C and FP16 + C itself);
`pairs` names which (default: every pair i < j). `compare_with: "self"` adds a target per trace
equal to its own logged configuration, to verify that traces reproduce where they were made.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    model_validator,
)

from replay_audit.diff.margin import DEFAULT_TAU
from replay_audit.engine.protocol import DEFAULT_B_TOP_K, Intervention, Target
from replay_audit.formats import (
    CATEGORIES,
    CONTROL_FRACTION,
    CONTROL_SEED,
    DECODE_WINDOW,
    FLAGGED_FRACTION,
    MODES,
    SCAN_FLAG_ULPS,
    TOP_K,
    Baseline,
    BodyDType,
    Category,
    Compare,
    CompareWith,
    Device,
    HeadDType,
    InterventionKind,
    MarginSource,
    Mode,
    ResultStatus,
    RunStatus,
    Screen,
    SingleStepKind,
    TokenIdsSource,
)
from replay_audit.input import InputModel, Lax, UtcDatetime, option_field
from replay_audit.json_value import JsonObject
from replay_audit.output import OutputModel
from replay_audit.queue.route import ANY_KIND, gpu_kind
from replay_audit.replays.domain import (
    DEFAULT_SCAN_FLAG_ULPS,
    ControlSample,
    ResolvedArm,
    RunTarget,
    routing_conflict,
)
from replay_audit.replays.models import MAX_RUN_NAME
from replay_audit.stats.report import RunStatistics
from replay_audit.traces.schemas import AttnKernelName, Tag, TpDegree, TraceFieldError
from replay_audit.traces.selection import TraceSelection

#: Largest number of traces one replay run may select (422 above it).
MAX_REPLAY_TRACES = 10_000
#: Largest number of targets in one run.
MAX_TARGETS = 8

assert set(MODES) == set(Mode.__args__)  # type: ignore[attr-defined]
assert set(CATEGORIES) == set(Category.__args__)  # type: ignore[attr-defined]


class InterventionSpec(InputModel):
    """The gate is `tau` or `tau_ulps`, never both (a 422 naming them, as the CLI refuses
    `--tau` with `--tau-ulps`); neither: the paper's absolute 1e-3."""

    kind: InterventionKind = "none"
    #: Absolute gate threshold on the top-two margin (null: the paper's 1e-3, unless tau_ulps).
    #: 0 = ungated.
    tau: float | None = Field(default=None, allow_inf_nan=False)
    #: Format-scaled gate: τ = tau_ulps ulps of the arm's lm_head format at the top-1 logit.
    tau_ulps: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    #: Intervention B: how many top rows to recompute in FP32.
    top_k: int = Field(default=DEFAULT_B_TOP_K, ge=1, le=1_000_000)

    @model_validator(mode="before")
    @classmethod
    def _one_gate(cls, data: Any, info: ValidationInfo) -> Any:
        both = isinstance(data, dict) and None not in (data.get("tau"), data.get("tau_ulps"))
        if both and (info.context or {}).get("stored"):
            # Written before both were refused, with the default tau beside tau_ulps, which is
            # the one that was used.
            return {k: v for k, v in data.items() if k != "tau"}
        if both:
            raise ValueError(
                "give tau (an absolute margin) or tau_ulps (ulps of the lm_head format), not both"
            )
        return data

    def to_domain(self) -> Intervention:
        tau = DEFAULT_TAU if self.tau is None else self.tau
        return Intervention(kind=self.kind, tau=tau, tau_ulps=self.tau_ulps, top_k=self.top_k)


class TargetSpec(InputModel):
    dtype: BodyDType
    lm_head_dtype: HeadDType | None = None
    attn_kernel: AttnKernelName | None = None
    batch_size: int = Field(default=1, ge=1, le=64)
    intervention: InterventionSpec = InterventionSpec()
    #: Where to run it: "cuda" sends it to the gpu queue, "cpu" to the cpu queue; None = gpu
    #: queue under RQ, the in-process runner otherwise.
    device: Device | None = None
    #: The GPU kind to replay on: a worker's kind (`a10g`) or GPU name (`NVIDIA A10G`), or
    #: "any" (any GPU worker). None: the kind each trace was logged on (any GPU for a trace
    #: logged without one). Every target of a run names the same kind or none.
    gpu_kind: GpuKindName | None = None
    #: The tensor-parallel degree to replay at. None: each trace's logged degree (a trace
    #: logged at TP 2 waits for a worker owning 2 devices); another degree runs only when asked
    #: here, and the result says so (`resolved.logged_tp_degree`).
    tp_degree: TpDegree | None = None
    label: str | None = Field(default=None, max_length=100)

    def to_domain(self) -> RunTarget:
        return RunTarget(
            Target(
                dtype=self.dtype,
                lm_head_dtype=self.lm_head_dtype,
                attn_kernel=self.attn_kernel,
                batch_size=self.batch_size,
                intervention=self.intervention.to_domain(),
            ),
            device=self.device,
            label=self.label,
            gpu_kind=self.gpu_kind,
            tp_degree=self.tp_degree,
        )


def _gpu_kind(value: str) -> str:
    return value if value == ANY_KIND else gpu_kind(value)


#: A GPU kind or GPU name (normalised to its kind: `NVIDIA A10G` -> `a10g`), or "any".
GpuKindName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][\w .()/-]*$"),
    AfterValidator(_gpu_kind),
]


class TraceFilter(InputModel):
    """The `filter` of a replay request: the greedy traces matching every field given (a
    non-greedy trace is not selected, it does not fail the request). `tag` and `tags` both
    work: the trace carries `tag` and all of `tags`."""

    model_name: str | None = None
    weights_sha256: str | None = None
    config_id: str | None = None
    dtype: BodyDType | None = None
    tag: str | None = None
    tags: list[Tag] | None = Field(default=None, max_length=16)
    created_after: UtcDatetime | None = None
    created_before: UtcDatetime | None = None

    def to_selection(self) -> TraceSelection:
        """The traces this filter selects."""
        return TraceSelection(
            model_name=self.model_name,
            weights_sha256=self.weights_sha256,
            config_id=self.config_id,
            dtype=self.dtype,
            tags=(*([self.tag] if self.tag is not None else []), *(self.tags or [])),
            created_after=self.created_after,
            created_before=self.created_before,
            greedy=True,
        )


#: JSON Schema of the rule "at least one target, or the self-replay" (`compare_with: "self"`),
#: which the model validator enforces: the OpenAPI document states it too.
TARGETS_RULE: JsonObject = {
    "anyOf": [
        {"required": ["targets"], "properties": {"targets": {"minItems": 1}}},
        {"required": ["compare_with"], "properties": {"compare_with": {"const": "self"}}},
    ]
}
#: JSON Schema of "exactly one of trace_ids (a list) and filter (an object)".
SELECTION_RULE: JsonObject = {
    "oneOf": [
        {"required": ["trace_ids"], "properties": {"trace_ids": {"type": "array"}}},
        {"required": ["filter"], "properties": {"filter": {"type": "object"}}},
    ]
}
#: JSON Schema of "pairs (a list) only with compare: pairwise".
PAIRS_RULE: JsonObject = {
    "anyOf": [
        {"required": ["compare"], "properties": {"compare": {"const": "pairwise"}}},
        {"not": {"required": ["pairs"], "properties": {"pairs": {"type": "array"}}}},
    ]
}
#: JSON Schema of "compare: pairwise needs two targets or more (the self-replay counts)".
PAIRWISE_RULE: JsonObject = {
    "anyOf": [
        {"not": {"required": ["compare"], "properties": {"compare": {"const": "pairwise"}}}},
        {"required": ["targets"], "properties": {"targets": {"minItems": 2}}},
        {
            "required": ["targets", "compare_with"],
            "properties": {"targets": {"minItems": 1}, "compare_with": {"const": "self"}},
        },
    ]
}
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def _run_name(value: str) -> str:
    value = value.strip()
    if not value:
        raise ValueError("must not be blank")
    if _CONTROL.search(value):
        raise ValueError("must be one line without control characters")
    return value


#: A run's name: one line of 1..MAX_RUN_NAME characters, surrounding blanks stripped, no control
#: characters (NUL and the UTF-16 surrogates are refused by `InputModel` as for every string).
RunName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_RUN_NAME,
        description="a name for people, shown with the run's id",
    ),
    AfterValidator(_run_name),
]


#: A pair of comparisons: indices of targets (the self-replay, if any, is the last).
TargetIndex = Annotated[int, Field(ge=0, le=MAX_TARGETS)]


class ReplayCreate(InputModel):
    """A replay run. Exactly one of `trace_ids` and `filter`; at least one target, or
    `compare_with: "self"`. `compare: "pairwise"` needs two targets or more (the self-replay
    counts), and each of `pairs` names two different ones; `pairs` is only given with it."""

    model_config = ConfigDict(
        json_schema_extra={"allOf": [SELECTION_RULE, TARGETS_RULE, PAIRS_RULE, PAIRWISE_RULE]}
    )

    trace_ids: list[str] | None = Field(default=None, min_length=1, max_length=MAX_REPLAY_TRACES)
    filter: TraceFilter | None = None
    targets: list[TargetSpec] = Field(default_factory=list, max_length=MAX_TARGETS)
    #: None: scan_then_decode for a large run (`REPLAY_AUDIT_LARGE_RUN_TRACES` traces or more),
    #: decode otherwise; the run's `mode` says which.
    mode: Mode | None = None
    #: scan_then_decode: the share of the traces the scan does not flag that are decoded
    #: anyway (the control sample that estimates the scan's miss rate), and its seed.
    control_fraction: float = option_field(CONTROL_FRACTION)
    control_seed: int = option_field(CONTROL_SEED)
    #: scan_then_decode: the share of the traces the scan flags that are decoded (the flagged
    #: sample, drawn with `control_seed`, one draw per trace for either reason): by a mismatch,
    #: from the first disagreement, the others keeping the scan's result (screen
    #: `flagged_scanned`); by a near-tie, from the prompt, the others only scanned (screen
    #: `near_tie_scanned`). None: 1 (all), but a large
    #: run naming no mode gets `REPLAY_AUDIT_LARGE_RUN_FLAGGED_FRACTION`; the run records it.
    flagged_fraction: float | None = option_field(FLAGGED_FRACTION, default=None)
    #: scan_then_decode: a trace whose scan agrees with the logged output is still decoded
    #: (screen `near_tie`) when some step's top-2 margin along the logged path is at most this
    #: many ulps of the arm's format; negative: off (mismatches only). None: the deployment's
    #: `REPLAY_AUDIT_SCAN_FLAG_ULPS`; the run records the value it used.
    scan_flag_ulps: float | None = option_field(SCAN_FLAG_ULPS, default=None)
    #: decode and scan_then_decode: a decode compared with the logged tokens stops this many
    #: tokens after t* (the result says so: `window_cut`, its output a prefix); t*, the
    #: margins, the category and the interventions' verdicts are the whole decode's. None: to
    #: eos or the budget. Not with mode scan (no decode) or compare pairwise (no logged output
    #: to find t* against while decoding).
    decode_window: int | None = option_field(DECODE_WINDOW, default=None)
    #: How the single-step probe at t* runs (docs/replays.md "The single-step probe"):
    #: teacher_forced, row t* of each arm's forward over prompt ‖ arm A's tokens (the scan's
    #: own where it ran); from_scratch, a forward over prompt ‖ y<t* alone.
    single_step: SingleStepKind = "teacher_forced"
    compare: Compare = "logged"
    pairs: list[Annotated[tuple[TargetIndex, TargetIndex], Lax]] | None = None
    compare_with: CompareWith | None = None
    #: A name for people (lists and page titles show it, with the id); not unique.
    name: RunName | None = None
    #: A client-chosen key: the same key in a project returns the existing run (no duplicate).
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)
    #: Top-k recorded per replayed step (kept with the result for the trace page).
    top_k: int = option_field(TOP_K)
    #: "auto": reproduce before comparing. The run first replays each trace in its own logged
    #: configuration (a self target, compared with the logged tokens) and reports how many
    #: reproduced; a trace that did not is judged against that replay in its comparisons with
    #: the logged tokens (each result's `baseline`: "reproduced"), and a trace of an engine
    #: this service cannot run (vLLM, SGLang) is always compared with it ("replayed").
    #: "off": no check; every comparison with the logged tokens is against them as logged.
    engine_check: Literal["auto", "off"] = "auto"

    def control_sample(self) -> ControlSample:
        return ControlSample(
            self.control_fraction,
            self.control_seed,
            DEFAULT_SCAN_FLAG_ULPS if self.scan_flag_ulps is None else self.scan_flag_ulps,
        )

    @model_validator(mode="after")
    def _check(self) -> ReplayCreate:
        if (self.trace_ids is None) == (self.filter is None):
            raise ValueError("give exactly one of trace_ids or filter")
        n_targets = len(self.targets) + (1 if self.compare_with == "self" else 0)
        if n_targets == 0:
            raise ValueError("targets: give at least one target (or compare_with: 'self')")
        if self.compare == "pairwise":
            if n_targets < 2:
                raise ValueError("targets: pairwise comparison needs at least two targets")
            for a, b in self.pairs or []:
                if not (0 <= a < n_targets and 0 <= b < n_targets and a != b):
                    raise ValueError(f"pairs: ({a}, {b}) does not name two different targets")
        elif self.pairs is not None:
            raise ValueError("pairs: only meaningful with compare: 'pairwise'")
        # A window would cut nothing: a scan decodes nothing, and a pairwise comparison has no
        # logged output to find t* against while it decodes.
        if self.decode_window is not None and self.mode == "scan":
            raise TraceFieldError("decode_window", "mode scan decodes nothing to cut")
        if self.decode_window is not None and self.compare == "pairwise":
            raise TraceFieldError(
                "decode_window",
                "compare pairwise decodes both arms in full (no logged output to stop after)",
            )
        conflict = routing_conflict([t.to_domain() for t in self.targets])
        if conflict is not None:
            i, why = conflict
            raise TraceFieldError(f"targets[{i}].gpu_kind", why)
        return self


class ReplayCreated(OutputModel):
    id: str
    created: bool


class Progress(OutputModel):
    total: int
    done: int
    failed: int
    pending: int


class ReplayRead(OutputModel):
    id: str
    project: str
    name: str | None = None
    status: RunStatus
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    request: JsonObject
    targets: list[JsonObject]
    comparisons: list[JsonObject]
    n_traces: int
    #: The mode the run replays in (a request naming none gets it by the large-run rule).
    mode: Mode | None = None
    #: Decodes compared with the logged tokens stop this many tokens after t* (results so cut
    #: say `window_cut`); None: decoded to eos or the budget.
    decode_window: int | None = None
    progress: Progress
    #: Throughput: results (trace x comparison) written per second since the run started, until
    #: it finished or now (None before the first result).
    results_per_s: float | None = None
    error: str | None
    #: The run's statistics (the same object `/report` and the UI show): stored when the run
    #: finished, computed over the results so far while it runs.
    statistics: RunStatistics | None = None
    #: Why jobs of the run wait with no worker to take them: the GPU kind or TP degree no live
    #: worker serves, the live workers, and what the request could change. None: every
    #: unfinished job has a live worker that serves it (or the run is finished).
    pending_reason: str | None = None
    #: What ran, per comparison: each distinct pair of resolved arms among its results and how
    #: many results ran it (the computation each arm ran, resolved once against each trace).
    ran: list[RanRead] = Field(default_factory=list)
    schedule_id: str | None = None


class ArmMarginRead(OutputModel):
    """An arm's top-2 margin at t*: absolute, in ulps of its lm_head format, and its source."""

    abs: float | None
    ulps: float | None
    source: MarginSource | None


class MarginsRead(OutputModel):
    """Both arms' margins at t*."""

    a: ArmMarginRead
    b: ArmMarginRead


class RanRead(OutputModel):
    """Results of one comparison that ran one pair of resolved arms."""

    comparison: int
    #: Arm A's computation (null: the logged tokens, or not recorded), and arm B's.
    a: ResolvedArm | None
    b: ResolvedArm | None
    #: `ResolvedArm.label()` of each (`logged tokens` for arm A against the logged tokens).
    label_a: str
    label_b: str
    results: int


class SingleStepChoiceRead(OutputModel):
    token: int
    margin: ArmMarginRead | None
    #: rerun: the arm's probe here with its whole computation (`kind`); logged_token: the
    #: logged token stands in for a re-run of a format that cannot run here.
    source: Literal["rerun", "logged_token"]


class SingleStepRead(OutputModel):
    """Both arms' single-step probes at t*: does the flip reproduce?"""

    step: int
    a: SingleStepChoiceRead | None
    b: SingleStepChoiceRead
    disagree: bool | None
    #: teacher_forced: row t* of each arm's forward over prompt ‖ arm A's tokens;
    #: from_scratch: a forward over prompt ‖ y<t* alone (results of earlier releases).
    kind: SingleStepKind = "from_scratch"


class SemanticRead(OutputModel):
    """The answers extracted from both arms' texts, and whether they agree."""

    extractor: str
    answer_a: str | None
    answer_b: str | None
    agree: bool | None
    neither_answered: bool
    correct_a: bool | None
    correct_b: bool | None


class ArmRead(OutputModel):
    """One arm of a result. For arm A of a comparison against the logged tokens, what was not
    run here (output, steps, gate firings) is null."""

    #: The configuration the arm stands for (the run's target with the kernel that ran, or
    #: the trace's logged configuration).
    target: JsonObject | None
    #: What ran for the arm here (null: the logged tokens, not run here).
    resolved: ResolvedArm | None = None
    #: Whether the comparison's gate fires at t* on this arm's margin (null: no divergence, or
    #: the margin is unknown).
    gate_fired_at_divergence: bool | None = None
    output_token_ids: list[int] | None
    gate_triggers: int | None
    steps: int | None
    trigger_rate: float | None
    mean_gap: float | None
    changed_steps: int | None
    gate_fired_steps: list[int] | None
    #: Per-step margins (6 significant digits; a display track).
    margins: list[float | None] | None
    environment: JsonObject | None
    text: str | None
    #: Each output token's piece: its text, or its bytes (integers 0..255) where they are not
    #: text alone. For arm A against the logged tokens, the logged tokens' pieces read by the
    #: worker when the trace has none stored; null where no tokenizer was at hand.
    token_pieces: list[str | list[int]] | None = None


class ArmsRead(OutputModel):
    a: ArmRead
    b: ArmRead


class ReplayResultRead(OutputModel):
    run_id: str
    trace_id: str
    comparison: int
    status: ResultStatus
    error: str | None
    exact_match: bool | None
    first_divergence_step: int | None
    margin_at_divergence: MarginsRead | None
    category: Category | None
    #: Arm B's gate firings (both arms': `arms.a.gate_triggers`, `arms.b.gate_triggers`).
    gate_triggers: int | None
    trigger_rate: float | None
    mean_gap: float | None
    tie: bool | None
    cascade_length: int | None
    length_difference: int | None
    mode: Mode | None = None
    #: scan_then_decode: flagged (decoded from the scan's first disagreement), control (not
    #: flagged, decoded in full) or scanned (only scanned: `exact_match` and `category` null).
    screen: Screen | None = None
    #: An arm's decode stopped at the run's `decode_window` tokens after t* (arm B's; either
    #: arm's where both were decoded from the prompt): its `output_token_ids` and text are a
    #: prefix of the whole continuation (t*, the margins,
    #: the category are the whole decode's), and `cascade_length`, `length_difference` and
    #: the answers are null. False: decoded to eos or the budget.
    window_cut: bool = False
    #: What this comparison was judged against: "logged" (the logged tokens, arm A), or the
    #: logged configuration replayed here (arm A decoded here): "reproduced" where the trace
    #: did not reproduce in its own configuration (the run's reproduction check diverged, so
    #: no flip is counted against logged tokens this stack does not give), "replayed" for a
    #: trace of an engine this service cannot run (vLLM, SGLang).
    baseline: Baseline = "logged"
    arms: ArmsRead | None = None
    single_step: SingleStepRead | None = None
    semantic: SemanticRead | None = None
    #: In a run that reproduces first (`engine_check: auto`): whether the trace's logged
    #: tokens reproduced here in its own logged configuration (the check's exact match).
    #: None in a run without the check, or while the check has no result yet.
    engine_reproduced: bool | None = None
    #: For an imported trace: where its token ids come from (`formats.TokenIdsSource`; a
    #: `retokenized` trace's divergence may be a non-canonical split of the logged text). None
    #: for a trace that logged its ids.
    token_ids_source: TokenIdsSource | None = None
    created_at: datetime


class Page(OutputModel):
    items: list[ReplayResultRead]
    next_cursor: str | None
