"""The category of a replay: the paper's per-prompt stratification (Table "Per-prompt
stratification"), as DESIGN.md defines it. Pure.

    agreed          the arms are token-identical
    head_reachable  the gate would fire at t* (the smaller of the two arms' margins is below τ)
                    and the flip reproduces in a single-step re-run from scratch: the current
                    step's arithmetic alone flips it, so Intervention C can fix it
    kv_dependent    the gate would fire at t*, but the single-step re-run agrees: the flip needs
                    the precision-specific KV cache, so C may not fix it
    body_dominated  the margin at t* is ≥ τ in both arms: the gate does not fire; the error came
                    from the transformer body
"""

from __future__ import annotations

from replay_audit.diff.margin import GateRule, Margin
from replay_audit.formats import Category


def gate_fires_at_divergence(
    logged: Margin | None,
    replay: Margin | None,
    *,
    logged_format: str,
    replay_format: str,
    gate: GateRule,
) -> bool:
    """Whether the gate would fire at t*: in either arm (each in its own lm_head format), which
    for an absolute τ is min(Δ_logged, Δ_replay) < τ. An arm with no margin (unknown) does not
    count; with neither known, the gate is taken as not firing."""
    fired = False
    if logged is not None:
        fired |= gate.fires(logged.abs, logged.top1, logged_format)
    if replay is not None:
        fired |= gate.fires(replay.abs, replay.top1, replay_format)
    return fired


def classify(
    t_star: int | None,
    *,
    gate_fired: bool,
    single_step_disagrees: bool | None,
) -> Category:
    """The category of a replay from t* (None when exact), whether the gate would fire at t*
    (`gate_fires_at_divergence`), and whether the single-step re-run at t* gives different
    tokens in the two formats (needed only when the gate fires)."""
    if t_star is None:
        return "agreed"
    if not gate_fired:
        return "body_dominated"
    if single_step_disagrees is None:
        raise ValueError("the gate fires at t*: the single-step re-run result is needed")
    return "head_reachable" if single_step_disagrees else "kv_dependent"
