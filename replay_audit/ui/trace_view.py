"""What the trace page shows for one trace and one comparison of a run: both arms' tokens
aligned by step with t* marked, their texts, their margin tracks and their configurations."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from markupsafe import Markup

from replay_audit.diff.margin import step_numerics
from replay_audit.replays.models import ReplayResult, ReplayRun
from replay_audit.reports.service import arm_label, comparison_label
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
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StepRow:
    step: int
    token_a: int | None
    token_b: int | None
    margin_a: float | None
    margin_b: float | None
    gate_fired: bool
    is_t_star: bool


@dataclass
class TraceView:
    comparison: int
    label: str
    result: ReplayResult
    arm_a: Arm
    arm_b: Arm
    t_star: int | None
    window_start: int
    step_rows: list[StepRow]
    chart: Markup
    logged_top_k: list[tuple[int, float]] | None
    margin_at_divergence: dict[str, Any] | None


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


def build(run: ReplayRun, trace: Trace, result: ReplayResult) -> TraceView:
    """The trace page's model for `result` (one comparison of `trace` in `run`)."""
    comp = run.comparisons[result.comparison]
    detail = dict(result.detail or {})
    t_star = result.first_divergence_step
    start = max(0, t_star - MAX_TOKENS_SHOWN // 4) if t_star and t_star >= MAX_TOKENS_SHOWN else 0
    b_ids = result.output_b.tolist() if result.output_b is not None else []
    logged_config = json.loads(trace.config.config_json)
    if comp["a"] == "logged":
        a_ids = trace.output_token_ids.tolist()
        a_margins = logged_margins(trace)
        notes = []
        if a_margins is None:
            notes.append("the trace carries no logged top-k: no logged margin track")
        if detail.get("logged_environment"):
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
            environment=detail.get("logged_environment"),
            notes=notes,
        )
    else:
        logged_arm = detail.get("logged_arm") or {}
        a_ids = result.output_a.tolist() if result.output_a is not None else []
        arm_a = Arm(
            name="a",
            label=arm_label(run, comp["a"]),
            tokens=_tokens(a_ids, t_star, start),
            n_tokens=len(a_ids),
            text=logged_arm.get("text"),
            margins=logged_arm.get("margins"),
            requested={"target": run.targets[int(comp["a"])], "engine": logged_arm.get("target")},
            environment=detail.get("logged_environment"),
        )
    arm_b = Arm(
        name="b",
        label=arm_label(run, comp["b"]),
        tokens=_tokens(b_ids, t_star, start),
        n_tokens=len(b_ids),
        text=detail.get("replay_text"),
        margins=detail.get("margins"),
        requested={"target": run.targets[int(comp["b"])], "engine": detail.get("target")},
        environment=detail.get("environment"),
    )
    if arm_b.margins is None and result.status == "ok":
        arm_b.notes.append("this result predates stored margin tracks")
    fired = [int(t) for t in detail.get("gate_fired_steps") or []]
    fired_set = set(fired)
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
                    gate_fired=t in fired_set,
                    is_t_star=t == t_star,
                )
            )
    iv = ((detail.get("target") or {}).get("intervention")) or {}
    tau = iv.get("tau") if iv.get("tau_ulps") is None else None
    top_k = None
    if comp["a"] == "logged" and t_star is not None and trace.top_k and trace.top_k_ids is not None:
        k = trace.top_k
        if t_star < trace.n_output_tokens and trace.top_k_logits is not None:
            ids = trace.top_k_ids[t_star * k : (t_star + 1) * k].tolist()
            logits = trace.top_k_logits[t_star * k : (t_star + 1) * k].tolist()
            top_k = [(int(i), float(v)) for i, v in zip(ids, logits, strict=True)]
    return TraceView(
        comparison=result.comparison,
        label=comparison_label(run, result.comparison),
        result=result,
        arm_a=arm_a,
        arm_b=arm_b,
        t_star=t_star,
        window_start=start,
        step_rows=rows,
        chart=margin_track_chart(
            arm_b.margins,
            arm_a.margins,
            fired,
            t_star,
            tau=float(tau) if tau else None,
        ),
        logged_top_k=top_k,
        margin_at_divergence=detail.get("margin_at_divergence"),
    )
