"""What the trace page shows for one trace and one comparison of a run: both arms' tokens
aligned by step with t* marked, their texts, their margin tracks and their configurations."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from markupsafe import Markup

from replay_audit.diff.margin import step_numerics
from replay_audit.replays.domain import arm_label, comparison_label
from replay_audit.replays.models import ReplayResult, ReplayRun
from replay_audit.replays.results import result_read
from replay_audit.replays.schemas import ArmRead, MarginsRead, ReplayResultRead
from replay_audit.traces.models import Trace
from replay_audit.ui.charts import margin_track_chart

#: Output tokens shown per arm (a window around t* beyond it).
MAX_TOKENS_SHOWN: Final = 2048
#: Steps either side of t* in the step table.
STEP_WINDOW: Final = 3


@dataclass(frozen=True)
class Token:
    step: int
    id: int
    #: "same" before t*, "t-star" at it, "after" past it.
    kind: str


@dataclass
class Arm:
    name: str
    label: str
    tokens: list[Token]
    n_tokens: int
    text: str | None
    margins: list[float | None] | None
    #: The configuration asked for (the logged record, or the run's target).
    requested: dict[str, Any] | None
    #: What the engine reports it really ran (None for a production arm we did not run).
    environment: dict[str, Any] | None
    #: Gate firings and steps of an arm run here (None: the logged arm, not run here).
    gate_fired_steps: list[int] | None = None
    gate_triggers: int | None = None
    steps: int | None = None
    trigger_rate: float | None = None
    changed_steps: int | None = None
    mean_gap: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StepRow:
    step: int
    token_a: int | None
    token_b: int | None
    margin_a: float | None
    margin_b: float | None
    gate_fired_a: bool
    gate_fired_b: bool
    is_t_star: bool


@dataclass
class TraceView:
    comparison: int
    label: str
    result: ReplayResult
    #: The result as the API gives it (the one mapping from rows).
    read: ReplayResultRead
    arm_a: Arm
    arm_b: Arm
    t_star: int | None
    window_start: int
    step_rows: list[StepRow]
    chart: Markup
    logged_top_k: list[tuple[int, float]] | None
    margin_at_divergence: MarginsRead | None


def logged_margins(trace: Trace) -> list[float | None] | None:
    """Top-1 minus top-2 of the logged per-step top-k logits, where the trace carries them."""
    if not trace.top_k or trace.top_k < 2 or trace.top_k_logits is None:
        return None
    logits = np.asarray(trace.top_k_logits).reshape(trace.n_output_tokens, trace.top_k)
    return [float(m) for m in step_numerics(logits).margins]


def _tokens(ids: list[int], t_star: int | None, start: int) -> list[Token]:
    out = []
    for step in range(start, min(len(ids), start + MAX_TOKENS_SHOWN)):
        if t_star is None or step < t_star:
            kind = "same"
        elif step == t_star:
            kind = "t-star"
        else:
            kind = "after"
        out.append(Token(step, int(ids[step]), kind))
    return out


def _at(values: list[Any] | None, t: int) -> Any:
    return values[t] if values is not None and 0 <= t < len(values) else None


def _run_here(arm: Arm, read: ArmRead) -> Arm:
    arm.gate_fired_steps = list(read.gate_fired_steps or [])
    arm.gate_triggers = read.gate_triggers
    arm.steps = read.steps
    arm.trigger_rate = read.trigger_rate
    arm.changed_steps = read.changed_steps
    arm.mean_gap = read.mean_gap
    return arm


def build(
    run: ReplayRun,
    trace: Trace,
    result: ReplayResult,
    *,
    engine_reproduced: bool | None = None,
) -> TraceView:
    """The trace page's model for `result` (one comparison of `trace` in `run`)."""
    targets = run.run_targets
    comp = run.run_comparisons[result.comparison]
    read = result_read(result, trace.public_id, run.public_id, engine_reproduced=engine_reproduced)
    empty = ArmRead(
        target=None,
        output_token_ids=None,
        gate_triggers=None,
        steps=None,
        trigger_rate=None,
        mean_gap=None,
        changed_steps=None,
        gate_fired_steps=None,
        margins=None,
        environment=None,
        text=None,
    )
    ra, rb = (read.arms.a, read.arms.b) if read.arms is not None else (empty, empty)
    t_star = result.first_divergence_step
    start = max(0, t_star - MAX_TOKENS_SHOWN // 4) if t_star and t_star >= MAX_TOKENS_SHOWN else 0
    b_ids = rb.output_token_ids or []
    logged_config = json.loads(trace.config.config_json)
    if comp.a == "logged":
        a_ids = trace.output_token_ids.tolist()
        a_margins = logged_margins(trace)
        notes = []
        if a_margins is None:
            notes.append("the trace carries no logged top-k: no logged margin track")
        if ra.environment:
            notes.append(
                "the logged format was re-run here for its margin at t* and the single-step "
                "re-run: its environment is shown"
            )
        arm_a = Arm(
            name="a",
            label="logged",
            tokens=_tokens(a_ids, t_star, start),
            n_tokens=len(a_ids),
            text=trace.output_text,
            margins=a_margins,
            requested=logged_config,
            environment=ra.environment,
            notes=notes,
        )
    else:
        a_ids = ra.output_token_ids or []
        arm_a = _run_here(
            Arm(
                name="a",
                label=arm_label(comp.a, targets),
                tokens=_tokens(a_ids, t_star, start),
                n_tokens=len(a_ids),
                text=ra.text,
                margins=ra.margins,
                requested={"target": run.targets[comp.a], "engine": ra.target},
                environment=ra.environment,
            ),
            ra,
        )
    arm_b = _run_here(
        Arm(
            name="b",
            label=arm_label(comp.b, targets),
            tokens=_tokens(b_ids, t_star, start),
            n_tokens=len(b_ids),
            text=rb.text,
            margins=rb.margins,
            requested={"target": run.targets[comp.b], "engine": rb.target},
            environment=rb.environment,
        ),
        rb,
    )
    if arm_b.margins is None and result.status == "ok":
        arm_b.notes.append("this result predates stored margin tracks")
    fired_a = set(arm_a.gate_fired_steps or [])
    fired_b = set(arm_b.gate_fired_steps or [])
    rows = []
    if t_star is not None:
        for t in range(max(0, t_star - STEP_WINDOW), t_star + STEP_WINDOW + 1):
            if t >= max(len(a_ids), len(b_ids)):
                break
            rows.append(
                StepRow(
                    step=t,
                    token_a=_at(a_ids, t),
                    token_b=_at(b_ids, t),
                    margin_a=_at(arm_a.margins, t),
                    margin_b=_at(arm_b.margins, t),
                    gate_fired_a=t in fired_a,
                    gate_fired_b=t in fired_b,
                    is_t_star=t == t_star,
                )
            )
    iv = ((rb.target or {}).get("intervention")) or {}
    tau = iv.get("tau") if iv.get("tau_ulps") is None else None
    top_k = None
    if comp.a == "logged" and t_star is not None and trace.top_k and trace.top_k_ids is not None:
        k = trace.top_k
        if t_star < trace.n_output_tokens and trace.top_k_logits is not None:
            ids = trace.top_k_ids[t_star * k : (t_star + 1) * k].tolist()
            logits = trace.top_k_logits[t_star * k : (t_star + 1) * k].tolist()
            top_k = [(int(i), float(v)) for i, v in zip(ids, logits, strict=True)]
    return TraceView(
        comparison=result.comparison,
        label=comparison_label(comp, targets),
        result=result,
        read=read,
        arm_a=arm_a,
        arm_b=arm_b,
        t_star=t_star,
        window_start=start,
        step_rows=rows,
        chart=margin_track_chart(
            arm_b.margins,
            arm_a.margins,
            sorted(fired_b),
            t_star,
            tau=float(tau) if tau else None,
            gate_fired_steps_a=sorted(fired_a),
        ),
        logged_top_k=top_k,
        margin_at_divergence=read.margin_at_divergence,
    )
