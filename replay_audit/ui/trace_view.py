"""What the trace page shows for one trace and one comparison of a run: both arms' tokens
aligned by step with t* marked, their texts, their margin tracks and their configurations."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from markupsafe import Markup

from replay_audit.diff.margin import step_numerics
from replay_audit.diff.pieces import Piece, from_json, joined, shown
from replay_audit.json_value import JsonObject
from replay_audit.replays.domain import arm_label, c_against_logged, comparison_label
from replay_audit.replays.models import ReplayResult, ReplayRun
from replay_audit.replays.results import result_read, token_ids_source
from replay_audit.replays.schemas import ArmRead, MarginsRead, ReplayResultRead
from replay_audit.stats.report import SAR_NOTES
from replay_audit.traces.models import Trace
from replay_audit.ui.charts import margin_track_chart

#: Output tokens shown per arm (a window around t* beyond it).
MAX_TOKENS_SHOWN: Final = 2048
#: Steps either side of t* in the step table.
STEP_WINDOW: Final = 3
#: How the note on a re-run of the logged format names where arm A's margin at t* came from.
_SOURCE_WORDS: Final[dict[str, str]] = {
    "logged_top_k": "the logged top-k's",
    "unavailable": "unavailable",
}


@dataclass(frozen=True)
class Token:
    step: int
    id: int
    #: "same" before t*, "t-star" at it, "after" past it.
    kind: str
    #: The token's piece as shown (None: no pieces stored, the id is shown).
    text: str | None = None
    #: The piece is bytes that are not text alone (shown escaped).
    is_bytes: bool = False
    #: The tooltip: step, id and both arms' margins at the step.
    title: str = ""


@dataclass(frozen=True)
class ArmText:
    """An arm's output text split at t*: before it, the t* token, everything after."""

    before: str
    at: str
    after: str


@dataclass
class ArmView:
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
    #: Each output token's piece, where stored (the trace's, or the worker's).
    pieces: tuple[Piece, ...] | None = None
    #: The text rebuilt from the pieces, split at t* (None without pieces).
    split_text: ArmText | None = None


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
    #: Each arm's token as its piece shows it (None: no pieces stored, the id alone).
    text_a: str | None = None
    text_b: str | None = None


@dataclass
class TraceView:
    comparison: int
    label: str
    result: ReplayResult
    #: The result as the API gives it (the one mapping from rows).
    read: ReplayResultRead
    arm_a: ArmView
    arm_b: ArmView
    t_star: int | None
    window_start: int
    step_rows: list[StepRow]
    chart: Markup
    logged_top_k: list[tuple[int, float]] | None
    margin_at_divergence: MarginsRead | None
    #: Intervention C on the replay arm only, against the logged tokens (a note says what
    #: that measures).
    c_against_logged: bool = False
    #: Why the answers are not compared (a scan has no replay text), as the run's SAR says.
    answers_note: str | None = None
    #: The trace's logits processors that every probe of the arms applied (None: none).
    logits_processors: str | None = None

    @property
    def token_ids_source(self) -> str:
        """Where the trace's token ids come from (`formats.TokenIdsSource`; logged if unsaid)."""
        return self.read.token_ids_source or "logged"


def logged_margins(trace: Trace) -> list[float | None] | None:
    """Top-1 minus top-2 of the logged per-step top-k logits, where the trace carries them."""
    if not trace.top_k or trace.top_k < 2 or trace.top_k_logits is None:
        return None
    logits = np.asarray(trace.top_k_logits).reshape(trace.n_output_tokens, trace.top_k)
    return [float(m) for m in step_numerics(logits).margins]


def _margin_text(value: float | None) -> str:
    return "none" if value is None else f"{value:.6g}"


def _tokens(
    ids: list[int],
    pieces: tuple[Piece, ...] | None,
    t_star: int | None,
    start: int,
    margins: tuple[tuple[str, list[float | None] | None], ...],
) -> list[Token]:
    if pieces is not None and len(pieces) != len(ids):
        pieces = None  # not this output's pieces: ids only
    out = []
    for step in range(start, min(len(ids), start + MAX_TOKENS_SHOWN)):
        if t_star is None or step < t_star:
            kind = "same"
        elif step == t_star:
            kind = "t-star"
        else:
            kind = "after"
        head = f"t* = step {step}" if kind == "t-star" else f"step {step}"
        title = f"{head}: token {int(ids[step])}" + "".join(
            f" · margin {label} {_margin_text(_at(values, step))}" for label, values in margins
        )
        piece = pieces[step] if pieces is not None else None
        out.append(
            Token(
                step,
                int(ids[step]),
                kind,
                text=shown(piece) if piece is not None else None,
                is_bytes=isinstance(piece, bytes),
                title=title,
            )
        )
    return out


def _shown_at(pieces: tuple[Piece, ...] | None, t: int) -> str | None:
    return shown(pieces[t]) if pieces is not None and 0 <= t < len(pieces) else None


def _split_text(pieces: tuple[Piece, ...] | None, t_star: int | None) -> ArmText | None:
    if pieces is None:
        return None
    if t_star is None or t_star >= len(pieces):
        return ArmText(joined(pieces), "", "")
    return ArmText(
        joined(pieces[:t_star]), joined(pieces[t_star : t_star + 1]), joined(pieces[t_star + 1 :])
    )


def _pieces(values: list[str | list[int]] | None, n: int) -> tuple[Piece, ...] | None:
    """Stored pieces as domain values, when there is one per token."""
    return None if values is None or len(values) != n else from_json(values)


def _at(values: list[Any] | None, t: int) -> Any:
    return values[t] if values is not None and 0 <= t < len(values) else None


def _run_here(name: str, label: str, target: JsonObject, read: ArmRead) -> ArmView:
    """Arm `name` as replayed here: its tokens, margins, gate and environment from `read`."""
    n_tokens = len(read.output_token_ids or [])
    return ArmView(
        name=name,
        label=label,
        tokens=[],
        n_tokens=n_tokens,
        text=read.text,
        margins=read.margins,
        requested={"target": target, "engine": read.target},
        environment=read.environment,
        gate_fired_steps=list(read.gate_fired_steps or []),
        gate_triggers=read.gate_triggers,
        steps=read.steps,
        trigger_rate=read.trigger_rate,
        changed_steps=read.changed_steps,
        mean_gap=read.mean_gap,
        pieces=_pieces(read.token_pieces, n_tokens),
    )


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
    logged_config = json.loads(trace.config.config_json)
    read = result_read(
        result,
        trace.public_id,
        run.public_id,
        engine_reproduced=engine_reproduced,
        token_ids_source=token_ids_source(logged_config),
    )
    empty = ArmRead.model_validate(dict.fromkeys(ArmRead.model_fields))  # a failed result's
    ra, rb = (read.arms.a, read.arms.b) if read.arms is not None else (empty, empty)
    t_star = result.first_divergence_step
    start = max(0, t_star - MAX_TOKENS_SHOWN // 4) if t_star and t_star >= MAX_TOKENS_SHOWN else 0
    b_ids = rb.output_token_ids or []
    if comp.a == "logged":
        a_ids = trace.output_token_ids.tolist()
        a_margins = logged_margins(trace)
        notes = []
        if a_margins is None:
            notes.append("the trace carries no logged top-k: no logged margin track")
        source_a = (
            read.margin_at_divergence.a.source if read.margin_at_divergence is not None else None
        )
        if source_a == "reconstructed":
            notes.append(
                "the logged format was re-run here for its margin at t* and the single-step "
                "re-run: its environment is shown"
            )
        elif ra.environment:
            notes.append(
                "the logged format was re-run here for the single-step re-run only (its margin "
                f"at t* is {_SOURCE_WORDS.get(source_a or '', 'not known')}): its environment "
                "is shown"
            )
        arm_a = ArmView(
            name="a",
            label="logged",
            tokens=[],
            n_tokens=len(a_ids),
            text=trace.output_text,
            margins=a_margins,
            requested=logged_config,
            environment=ra.environment,
            notes=notes,
            pieces=_pieces(trace.output_token_pieces or ra.token_pieces, len(a_ids)),
        )
    else:
        a_ids = ra.output_token_ids or []
        arm_a = _run_here("a", arm_label(comp.a, targets), run.targets[comp.a], ra)
    arm_b = _run_here("b", arm_label(comp.b, targets), run.targets[comp.b], rb)
    margins = ((arm_a.label, arm_a.margins), (arm_b.label, arm_b.margins))
    for arm, ids in ((arm_a, a_ids), (arm_b, b_ids)):
        arm.tokens = _tokens(ids, arm.pieces, t_star, start, margins)
        arm.split_text = _split_text(arm.pieces, t_star)
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
                    text_a=_shown_at(arm_a.pieces, t),
                    text_b=_shown_at(arm_b.pieces, t),
                )
            )
    # The gate that ran for arm B (its absolute τ; none drawn for a gate in ulps).
    iv = rb.resolved.intervention if rb.resolved is not None else None
    tau = iv.tau if iv is not None and iv.tau_ulps is None else None
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
            label_a=arm_a.label,
            label_b=arm_b.label,
        ),
        logged_top_k=top_k,
        margin_at_divergence=read.margin_at_divergence,
        c_against_logged=c_against_logged(comp, targets),
        answers_note=SAR_NOTES["scan"] if read.mode == "scan" else None,
        logits_processors=_processors(rb),
    )


def _processors(arm: ArmRead) -> str | None:
    """The logits processors arm B ran (the trace's: both arms ran the same), as a label."""
    p = arm.resolved.logits_processors if arm.resolved is not None else None
    return p.label() if p is not None else None
