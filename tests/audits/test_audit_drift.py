"""Trend points and drift flags, computed from real run statistics (the one builder,
`stats.report.run_statistics`, over synthetic result figures); the rules' false-alarm rate
under H0 and power by simulation; old stored shapes still read."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from replay_audit.audits.drift import (
    MIN_TRAILING_RUNS,
    TRAILING_RUNS,
    DriftRules,
    detect_drift,
    run_metrics,
)
from replay_audit.audits.metrics import ComparisonMetrics, Flag, RunMetrics
from replay_audit.replays.domain import (
    Comparison,
    RunTarget,
    comparison_label,
    is_treatment,
)
from replay_audit.stats.report import ComparisonInput, ResultFigures, RunStatistics, run_statistics

TARGETS = [
    {"dtype": "fp16", "intervention": {"kind": "none"}},
    {"dtype": "fp16", "intervention": {"kind": "C", "tau": 1e-3}, "label": "FP16 + C"},
    {"self": True, "label": "self (logged configuration)"},
]
COMPARISONS = [{"index": i, "a": "logged", "b": i} for i in range(3)]


def _row(
    trace: int, comparison: int, exact: bool, category: str, steps: int = 10, triggers: int = 0
) -> tuple[int, ResultFigures]:
    return comparison, ResultFigures(
        trace_id=trace,
        trace_public_id=f"tr_{trace}",
        external_id=None,
        status="ok",
        exact_match=exact,
        first_divergence_step=None if exact else 3,
        category=category,
        margin_a=None,
        margin_a_ulps=None,
        margin_b=None,
        margin_b_ulps=None,
        gate_triggers=triggers,
        n_steps=steps,
        mean_gap=1.0,
        gate_triggers_a=None,
        n_steps_a=None,
        length_difference=None if exact else 0,
        answer_extractor=None,
        answer_a=None,
        answer_b=None,
    )


def _targets(targets: list[dict[str, Any]]) -> list[RunTarget]:
    return [RunTarget.from_json(t) for t in targets]


def aggregate(
    n: int,
    fp16_flips: int,
    *,
    c_fixes: int | None = None,
    self_flips: int = 0,
    category: str = "head_reachable",
    targets: list[dict[str, Any]] = TARGETS,
) -> RunStatistics:
    """n traces; the first `fp16_flips` diverge in FP16, C repairs `c_fixes` of them."""
    c_fixes = fp16_flips if c_fixes is None else c_fixes
    rows = []
    for t in range(n):
        flip = t < fp16_flips
        rows.append(_row(t, 0, not flip, category if flip else "agreed"))
        still = flip and t >= c_fixes
        rows.append(
            _row(t, 1, not still, category if still else "agreed", triggers=2 if flip else 0)
        )
        sflip = t < self_flips
        rows.append(_row(t, 2, not sflip, "body_dominated" if sflip else "agreed"))
    run_targets = _targets(targets)
    inputs = []
    for c in map(Comparison.from_json, COMPARISONS):
        figures = [f for i, f in rows if i == c.index]
        label = comparison_label(c, run_targets)
        inputs.append(
            ComparisonInput(c.index, c.a, c.b, label, is_treatment(c, run_targets), figures)
        )
    return run_statistics("rr_test", inputs)


def metrics(n: int, flips: int, **kw: Any) -> RunMetrics:
    return run_metrics(aggregate(n, flips, **kw), _targets(TARGETS))


def rules(points: float = 5.0, **kw: Any) -> DriftRules:
    return DriftRules(ear_drop_points=points, **kw)


def _kinds(flags: list[Flag], kind: str) -> list[Flag]:
    return [f for f in flags if f.kind == kind]


def test_trend_point_headline_numbers() -> None:
    m = metrics(40, 10)
    assert m.ear == pytest.approx(0.75)
    assert m.ear_low is not None and m.ear_high is not None
    assert m.ear_low < 0.75 < m.ear_high
    assert m.baseline == 0
    assert m.c_lift is not None and m.c_lift.comparison == 1
    assert m.c_lift.lift == pytest.approx(0.25)
    assert m.c_lift.fixed == 10 and m.c_lift.broke == 0
    assert m.trigger_rate == pytest.approx(20 / 400)  # the C comparison's gate
    assert m.categories == {
        "agreed": 30,
        "head_reachable": 10,
        "kv_dependent": 0,
        "body_dominated": 0,
    }
    assert m.self_agreement == 1.0
    assert [c.label for c in m.comparisons] == [
        "fp16",
        "FP16 + C",
        "self (logged configuration)",
    ]
    assert [c.is_self for c in m.comparisons] == [False, False, True]
    # The counts the drift tests use, straight from RunStatistics.
    assert [(c.exact, c.n) for c in m.comparisons] == [(30, 40), (40, 40), (40, 40)]


def test_stored_json_round_trip_keeps_the_old_keys() -> None:
    m = metrics(40, 10)
    stored = m.model_dump(mode="json", by_alias=True)
    assert stored["comparisons"][2]["self"] is True  # the key old rows and the API use
    assert RunMetrics.model_validate(stored) == m


def test_no_c_lift_without_a_plain_baseline() -> None:
    targets = [TARGETS[1], TARGETS[0], TARGETS[2]]  # C first: no lift "of C over the baseline"
    m = run_metrics(aggregate(20, 5, targets=targets), _targets(targets))
    assert m.c_lift is None


def test_labels() -> None:
    b = RunTarget.from_json(
        {"dtype": "bf16", "lm_head_dtype": "fp8_e4m3", "intervention": {"kind": "B"}}
    )
    assert b.display_label() == "bf16 / head fp8_e4m3 + B(τ=0.001)"
    assert RunTarget.from_json({"self": True}).display_label() == "self"
    stored = RunTarget(None).to_json()
    assert RunTarget.from_json(stored).display_label() == "self (logged configuration)"


def test_a_self_replay_gets_no_lift() -> None:
    stats = aggregate(20, 5, self_flips=3)
    assert [(lf.comparison_a, lf.comparison_b) for lf in stats.lifts] == [(0, 1)]


def test_ear_drop_is_a_test_on_the_counts() -> None:
    history = [metrics(100, 5) for _ in range(7)]  # 95/100 every night: 665/700 pooled
    assert _kinds(detect_drift(metrics(100, 8), history, rules()), "ear_drop") == []
    [drop] = _kinds(detect_drift(metrics(100, 20), history, rules()), "ear_drop")
    assert (drop.comparison, drop.label) == (0, "fp16")
    assert drop.test is not None and drop.test.test == "fisher_exact_less"
    assert (drop.test.latest_successes, drop.test.latest_n) == (80, 100)
    assert (drop.test.baseline_successes, drop.test.baseline_n) == (665, 700)
    assert drop.test.baseline_runs == 7
    assert drop.test.p_value < drop.test.alpha == 0.01
    assert drop.drop_points == pytest.approx(15.0)
    assert drop.threshold_points == 5.0
    # The message says why: the rule's counts, the p-value against alpha.
    assert "80/100" in drop.message and "665/700" in drop.message
    assert "Fisher" in drop.message and "alpha 0.01" in drop.message
    assert drop.message.startswith("fp16: ")


def test_a_drop_larger_than_the_threshold_but_not_significant_is_silent() -> None:
    """95% -> 88% at n = 25: 7 points (over the threshold of 5) but p ~ 0.2."""
    history = [metrics(25, 1) for _ in range(3)]  # 72/75
    current = metrics(25, 3)
    assert _kinds(detect_drift(current, history, rules()), "ear_drop") == []
    # A significant drop smaller than the threshold is silent too (the threshold is the
    # practical size that matters): 95% -> 92% at 10,000 traces.
    history = [metrics(2_000, 100) for _ in range(3)]
    big = metrics(2_000, 160)
    assert _kinds(detect_drift(big, history, rules(5.0)), "ear_drop") == []
    assert _kinds(detect_drift(big, history, rules(2.0)), "ear_drop")


def _ear_only(exact: int, n: int) -> RunMetrics:
    c = ComparisonMetrics(index=0, label="FP16", n=n, exact=exact, ear=exact / n)
    return RunMetrics(comparisons=[c], ear=c.ear, baseline=0)


def test_the_issues_noise_case_does_not_fire() -> None:
    """The issue: 62.5% [30.6, 86.3] at n = 8 against a 3-run mean of 79.2%. As counts: 5/8
    against 19/24 pooled; p = 0.31. Silent however small min_n is set."""
    history = [_ear_only(6, 8), _ear_only(7, 8), _ear_only(6, 8)]  # 19/24 = 79.2%
    current = _ear_only(5, 8)
    assert detect_drift(current, history, rules()) == []
    assert detect_drift(current, history, rules(min_n=1)) == []
    # The old rule (mean minus EAR > 5 points) would have fired: 79.2 - 62.5 = 16.7.
    assert 100 * (19 / 24 - 5 / 8) > 5


def test_a_clear_drop_fires() -> None:
    """20/200 against 150/200 pooled over three runs."""
    history = [_ear_only(50, 67), _ear_only(50, 67), _ear_only(50, 66)]
    [flag] = detect_drift(_ear_only(20, 200), history, rules())
    assert flag.kind == "ear_drop" and flag.label == "FP16"
    assert flag.test is not None
    assert (flag.test.baseline_successes, flag.test.baseline_n) == (150, 200)
    assert flag.test.p_value < 1e-30


def test_min_n_on_each_side() -> None:
    history = [_ear_only(100, 100) for _ in range(3)]
    assert detect_drift(_ear_only(0, 5), history, rules()) == []  # 5 < min_n = 10
    assert detect_drift(_ear_only(0, 5), history, rules(min_n=5))  # p = C(300,0).../tiny
    tiny = [_ear_only(3, 3) for _ in range(3)]  # 9 baseline traces
    assert detect_drift(_ear_only(0, 100), tiny, rules()) == []
    assert detect_drift(_ear_only(0, 100), tiny, rules(min_n=9))


def test_ear_drop_pools_only_the_last_seven_runs() -> None:
    old_good = [metrics(100, 0) for _ in range(20)]
    recent = [metrics(100, 10) for _ in range(TRAILING_RUNS)]  # the schedule settled at 90%
    flags = detect_drift(metrics(100, 12), old_good + recent, rules())
    assert _kinds(flags, "ear_drop") == []


def test_ear_drop_needs_enough_history() -> None:
    history = [metrics(100, 0) for _ in range(MIN_TRAILING_RUNS - 1)]
    assert not _kinds(detect_drift(metrics(100, 50), history, rules()), "ear_drop")
    history.append(metrics(100, 0))
    assert _kinds(detect_drift(metrics(100, 50), history, rules()), "ear_drop")


def test_history_without_counts_is_not_a_baseline() -> None:
    """Rows stored before counts were kept (or partial ones) cannot be tested against."""
    old = RunMetrics.model_validate(
        {"comparisons": [{"index": 0, "self": False, "ear": 1.0, "categories": {"agreed": 8}}]}
    )
    assert old.comparisons[0].n is None
    assert detect_drift(metrics(100, 50), [old] * 5, rules()) == []


def test_self_disagreement() -> None:
    [flag] = detect_drift(metrics(50, 0, self_flips=1), [], rules())
    assert flag.kind == "self_disagreement"
    assert (flag.comparison, flag.label) == (2, "self (logged configuration)")
    assert flag.test is not None and flag.test.test == "deterministic"
    assert (flag.test.latest_successes, flag.test.latest_n, flag.test.p_value) == (49, 50, 0.0)
    assert "1 of 50 traces disagree" in flag.message and "98.0%" in flag.message


def test_new_category_only_when_significant_against_history() -> None:
    kv = metrics(50, 4, category="kv_dependent", c_fixes=0)
    assert detect_drift(kv, [], rules(50)) == []  # the first run has no "before"
    history = [metrics(50, 4, category="head_reachable")]
    new = _kinds(detect_drift(kv, history, rules(50)), "new_category")
    # 4 of 50 after 0 of 50: p = C(50,4)/C(100,4) = 0.058, not significant.
    assert new == []
    history = [metrics(50, 4, category="head_reachable") for _ in range(7)]
    new = _kinds(detect_drift(kv, history, rules(50)), "new_category")
    # 4 of 50 after 0 of 350: p = C(50,4)/C(400,4) ~ 2.2e-4.
    # kv_dependent appears in FP16 and (unrepaired) in FP16 + C for the first time.
    assert [(f.comparison, f.label, f.category) for f in new] == [
        (0, "fp16", "kv_dependent"),
        (1, "FP16 + C", "kv_dependent"),
    ]
    assert new[0].test is not None and new[0].test.test == "fisher_exact_greater"
    assert (new[0].test.latest_successes, new[0].test.baseline_n) == (4, 350)
    assert new[0].test.p_value == pytest.approx(math.comb(50, 4) / math.comb(400, 4), rel=1e-9)
    # Once seen, no longer new.
    assert not _kinds(detect_drift(kv, [*history, kv], rules(50)), "new_category")


def test_one_rare_divergence_is_not_news() -> None:
    history = [metrics(100, 0) for _ in range(7)]
    one = metrics(100, 1, category="kv_dependent", c_fixes=0)  # p = 100/800
    assert not _kinds(detect_drift(one, history, rules(50)), "new_category")


def _simulate(rng: np.random.Generator, p: float, n: int, runs: int) -> list[RunMetrics]:
    return [_ear_only(int(rng.binomial(n, p)), n) for _ in range(runs)]


@pytest.mark.parametrize("p", [0.6, 0.9])
def test_ear_drop_false_alarm_rate_under_the_null(p: float) -> None:
    """2,000 schedules that have not drifted (seven baseline runs and the latest, all of 40
    traces at one rate p), the threshold set to 0 so that only the test decides: the rule
    fires on at most alpha of them, plus 3 binomial standard errors of simulation slack."""
    rng = np.random.default_rng(14)
    sims, alpha = 2_000, 0.01
    fired = sum(
        bool(detect_drift(_simulate(rng, p, 40, 1)[0], _simulate(rng, p, 40, 7), rules(0.0)))
        for _ in range(sims)
    )
    assert fired / sims <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / sims)


def test_ear_drop_power_on_clear_drops() -> None:
    """90% nights, then a night at 70% (n = 100): caught nearly always."""
    rng = np.random.default_rng(15)
    sims = 300
    fired = sum(
        bool(detect_drift(_simulate(rng, 0.7, 100, 1)[0], _simulate(rng, 0.9, 100, 7), rules()))
        for _ in range(sims)
    )
    assert fired / sims >= 0.95


# -- verified groups: the one rule of a schedule with `verify` -----------------------------------


def _verified(*verdicts: tuple[str, str], status: str = "done") -> RunMetrics:
    """A run's point whose verification gave each (group, verdict)."""
    groups = [
        {
            "group": g,
            "verdict": v,
            "statistic": "outside_tie_band",
            "score": 0.4 if v == "inconsistent" else 0.01,
            "threshold": 0.05,
            "false_alarm_rate": 0.01,
            "tokens": 480,
            "traces": 10,
            "closest_benign": "fp16" if v == "inconsistent" else None,
            "null_quantiles": [0.0, 0.01],  # a report key the point does not keep
        }
        for g, v in verdicts
    ]
    return RunMetrics.model_validate(
        {"verification": {"id": "ver_x", "status": status, "groups": groups}}
    )


RULES = DriftRules(5.0)


@pytest.mark.parametrize(
    ("before", "flagged", "was"),
    [
        (None, True, "the schedule's first verdict on it"),
        (("a", "consistent"), True, "consistent in the previous verified run"),
        (("a", "insufficient"), True, "insufficient in the previous verified run"),
        (("b", "inconsistent"), True, "absent from the previous verified run"),
        (("a", "inconsistent"), False, None),
    ],
)
def test_a_group_is_flagged_when_it_turns_inconsistent(
    before: tuple[str, str] | None, flagged: bool, was: str | None
) -> None:
    history = [] if before is None else [_verified(before)]
    flags = detect_drift(_verified(("a", "inconsistent"), ("c", "consistent")), history, RULES)
    if not flagged:
        assert flags == []
        return
    [flag] = flags
    assert flag.kind == "group_inconsistent" and flag.group == flag.label == "a"
    assert flag.comparison is None and flag.test is None
    assert flag.verdict is not None and flag.verdict.score == 0.4
    assert flag.verdict.threshold == 0.05 and flag.verdict.false_alarm_rate == 0.01
    assert flag.previous_verdict == (before[1] if before and before[0] == "a" else None)
    assert was is not None and flag.message.endswith(f"({was})")
    assert flag.reason == flag.message and "0.4 above the benign null's threshold 0.05" in (
        flag.message
    )
    # Stored and read back as JSON, as `audit_runs.flags` keeps it.
    assert Flag.model_validate(flag.model_dump(mode="json")) == flag


def test_the_previous_verdict_is_the_last_finished_verification() -> None:
    """A night whose verification failed, or a run from before the schedule verified, is
    skipped: the group still inconsistent since the last verdict is not flagged again."""
    history = [
        _verified(("a", "consistent")),
        _verified(("a", "inconsistent")),
        _verified(status="failed"),
        RunMetrics(),
    ]
    assert detect_drift(_verified(("a", "inconsistent")), history, RULES) == []
    # Consistent again, then inconsistent: flagged again.
    history.append(_verified(("a", "consistent")))
    [flag] = detect_drift(_verified(("a", "inconsistent")), history, RULES)
    assert flag.previous_verdict == "consistent"
    # A failed verification now gives no verdict to flag.
    assert detect_drift(_verified(status="failed"), history, RULES) == []


def test_a_point_stored_before_verification_reads_without_it() -> None:
    point = RunMetrics.model_validate({"comparisons": [], "ear": 0.9})
    assert point.verification is None
    assert Flag.model_validate({"kind": "ear_drop", "comparison": 0}).group is None
