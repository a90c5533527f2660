"""The category rule (DESIGN.md), with hand-built arms for every category and edge."""

from __future__ import annotations

import pytest

from replay_audit.diff import (
    GateRule,
    classify,
    first_divergence,
    judge,
    margin,
)
from replay_audit.formats import CATEGORIES

G = GateRule(tau=1e-3)


def _category(
    logged: list[int],
    replay: list[int],
    logged_margin: tuple[float, float] | None,
    replay_margin: tuple[float, float] | None,
    single_step_disagrees: bool | None,
    gate: GateRule = G,
) -> str:
    t = first_divergence(logged, replay)
    lm = margin(*logged_margin, "bf16") if logged_margin else None
    rm = margin(*replay_margin, "fp16") if replay_margin else None
    if t is None:
        return classify(t, gate_fired=False, single_step_disagrees=None)
    rerun_b = None if single_step_disagrees is None else int(single_step_disagrees)
    verdict = judge(lm, rm, format_a="bf16", format_b="fp16", gate=gate, rerun_a=0, rerun_b=rerun_b)
    assert verdict.gate_fired == (verdict.category != "body_dominated")
    category = verdict.category
    assert category is not None, "the gate fires: the single-step re-run is needed"
    return category


def test_agreed() -> None:
    assert _category([1, 2, 3], [1, 2, 3], None, None, None) == "agreed"


def test_head_reachable_tie_at_step_0() -> None:
    # a BF16 tie at t* = 0, the flip reproduces from scratch
    assert _category([5, 2], [6, 2], (10.0, 10.0), (10.0, 9.9999), True) == "head_reachable"


def test_kv_dependent_at_the_last_step() -> None:
    # small FP16 margin at the last step; the single-step re-run agrees
    assert _category([1, 2, 3], [1, 2, 4], (10.0, 9.5), (10.0, 9.9995), False) == "kv_dependent"


def test_body_dominated_when_both_margins_are_large() -> None:
    assert _category([1, 2, 3], [1, 7, 3], (10.0, 9.0), (10.0, 9.5), True) == "body_dominated"
    # the single-step result does not matter when the gate does not fire
    assert _category([1, 2, 3], [1, 7, 3], (10.0, 9.0), (10.0, 9.5), None) == "body_dominated"


def test_min_of_the_two_margins_decides() -> None:
    # only the logged arm's margin is small: the gate still fires at t*
    assert _category([1, 2], [1, 3], (10.0, 9.9995), (10.0, 8.0), True) == "head_reachable"


def test_different_lengths_replay_ran_on() -> None:
    # the replay did not stop where the logged arm did: t* = len(logged), no logged margin there
    assert _category([1, 2], [1, 2, 9, 9], None, (5.0, 5.0), True) == "head_reachable"
    assert _category([1, 2], [1, 2, 9, 9], None, (5.0, 1.0), True) == "body_dominated"


def test_gate_in_ulps_widens_for_a_coarse_format() -> None:
    # margin 0.0625 at top-1 10: 1 ulp of bf16 (0.0625). τ = 1e-3 misses it, 2 ulps catches it.
    args = ([1, 2], [1, 3], (10.0, 9.9375), (10.0, 9.0), True)
    assert _category(*args) == "body_dominated"
    assert _category(*args, gate=GateRule(tau_ulps=2.0)) == "head_reachable"


def test_ungated_tau_zero_always_fires() -> None:
    assert _category([1], [2], (10.0, 1.0), (10.0, 1.0), False, GateRule(tau=0.0)) == "kv_dependent"


def test_a_firing_gate_needs_the_single_step_result() -> None:
    with pytest.raises(ValueError, match="single-step"):
        classify(3, gate_fired=True, single_step_disagrees=None)
    small = margin(10.0, 9.9995, "bf16")
    v = judge(small, None, format_a="bf16", format_b="fp16", gate=G, rerun_a=1, rerun_b=None)
    assert v.gate_fired_a and not v.gate_fired_b and v.category is None


def test_each_arm_is_judged_in_its_own_format_and_an_exact_tie_is_a_tie() -> None:
    tie = margin(10.0, 10.0, "bf16")
    wide = margin(10.0, 9.0, "fp16")
    v = judge(tie, wide, format_a="bf16", format_b="fp16", gate=G, rerun_a=3, rerun_b=4)
    assert (v.gate_fired_a, v.gate_fired_b, v.tie) == (True, False, True)
    assert v.single_step_disagrees and v.category == "head_reachable"


def test_categories_are_the_design_names() -> None:
    assert CATEGORIES == ("agreed", "head_reachable", "kv_dependent", "body_dominated")
