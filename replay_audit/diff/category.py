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

from dataclasses import dataclass

from replay_audit.diff.margin import GateRule, Margin, is_tie
from replay_audit.formats import Category


def classify(
    t_star: int | None,
    *,
    gate_fired: bool,
    single_step_disagrees: bool | None,
) -> Category:
    """The category (module docstring) of a replay; the re-run is needed only when the gate
    fires."""
    if t_star is None:
        return "agreed"
    if not gate_fired:
        return "body_dominated"
    if single_step_disagrees is None:
        raise ValueError("the gate fires at t*: the single-step re-run result is needed")
    return "head_reachable" if single_step_disagrees else "kv_dependent"


@dataclass(frozen=True)
class Verdict:
    """What `judge` says of a divergence at t*. `category` is None when the gate fires but no
    single-step re-run is known."""

    gate_fired_a: bool
    gate_fired_b: bool
    tie: bool
    single_step_disagrees: bool | None
    category: Category | None

    @property
    def gate_fired(self) -> bool:
        return self.gate_fired_a or self.gate_fired_b


def judge(
    margin_a: Margin | None,
    margin_b: Margin | None,
    *,
    format_a: str,
    format_b: str,
    gate: GateRule,
    rerun_a: int | None,
    rerun_b: int | None,
) -> Verdict:
    """The outcome rule at a divergence, written once (the replay pipeline and the screening
    both judge here): each arm's margin at t* against the comparison's gate, each in its own
    lm_head format (for an absolute τ, min(Δ_a, Δ_b) < τ; an arm with no margin, unknown, does
    not count), then the single-step re-runs' tokens (each from the arm's whole computation;
    None where unknown)."""
    fired_a = margin_a is not None and gate.fires(margin_a.abs, margin_a.top1, format_a)
    fired_b = margin_b is not None and gate.fires(margin_b.abs, margin_b.top1, format_b)
    disagrees = None if rerun_a is None or rerun_b is None else rerun_a != rerun_b
    category: Category | None
    if fired_a or fired_b:
        category = None if disagrees is None else "head_reachable" if disagrees else "kv_dependent"
    else:
        category = "body_dominated"
    return Verdict(fired_a, fired_b, is_tie(margin_a, margin_b), disagrees, category)
