"""Trend points and drift flags, computed from real run statistics (the one builder,
`stats.report.run_statistics`, over synthetic result figures)."""

from __future__ import annotations

from typing import Any

import pytest

from replay_audit.audits.drift import MIN_TRAILING_RUNS, detect_drift, run_metrics
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


def metrics(n: int, flips: int, **kw: Any) -> dict[str, Any]:
    return run_metrics(aggregate(n, flips, **kw), _targets(TARGETS))


def test_trend_point_headline_numbers() -> None:
    m = metrics(40, 10)
    assert m["ear"] == pytest.approx(0.75)
    assert m["ear_low"] < 0.75 < m["ear_high"]
    assert m["baseline"] == 0
    assert m["c_lift"]["comparison"] == 1
    assert m["c_lift"]["lift"] == pytest.approx(0.25)
    assert m["c_lift"]["fixed"] == 10 and m["c_lift"]["broke"] == 0
    assert m["trigger_rate"] == pytest.approx(20 / 400)  # the C comparison's gate
    assert m["categories"] == {
        "agreed": 30,
        "head_reachable": 10,
        "kv_dependent": 0,
        "body_dominated": 0,
    }
    assert m["self_agreement"] == 1.0
    assert [c["label"] for c in m["comparisons"]] == [
        "fp16",
        "FP16 + C",
        "self (logged configuration)",
    ]
    assert [c["self"] for c in m["comparisons"]] == [False, False, True]


def test_no_c_lift_without_a_plain_baseline() -> None:
    targets = [TARGETS[1], TARGETS[0], TARGETS[2]]  # C first: no lift "of C over the baseline"
    m = run_metrics(aggregate(20, 5, targets=targets), _targets(targets))
    assert m["c_lift"] is None


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


def test_ear_drop_against_the_trailing_mean() -> None:
    history = [metrics(100, 5) for _ in range(7)]  # EAR 95% every night
    assert detect_drift(metrics(100, 8), history, ear_drop_points=5.0) == []  # 3 points: fine
    flags = detect_drift(metrics(100, 12), history, ear_drop_points=5.0)  # 7 points below
    drops = [f for f in flags if f["kind"] == "ear_drop"]
    assert [f["comparison"] for f in drops] == [0]
    assert drops[0]["trailing_mean"] == pytest.approx(0.95)
    assert drops[0]["drop_points"] == pytest.approx(7.0)
    assert drops[0]["trailing_runs"] == 7


def test_ear_drop_uses_only_the_last_seven_runs() -> None:
    old_good = [metrics(100, 0) for _ in range(20)]
    recent = [metrics(100, 10) for _ in range(7)]  # the schedule settled at 90%
    assert [
        f
        for f in detect_drift(metrics(100, 12), old_good + recent, ear_drop_points=5)
        if f["kind"] == "ear_drop"
    ] == []


def test_ear_drop_needs_enough_history() -> None:
    history = [metrics(100, 0) for _ in range(MIN_TRAILING_RUNS - 1)]
    assert not [
        f
        for f in detect_drift(metrics(100, 50), history, ear_drop_points=5)
        if f["kind"] == "ear_drop"
    ]
    history.append(metrics(100, 0))
    assert [
        f
        for f in detect_drift(metrics(100, 50), history, ear_drop_points=5)
        if f["kind"] == "ear_drop"
    ]


def test_self_disagreement() -> None:
    flags = detect_drift(metrics(50, 0, self_flips=1), [], ear_drop_points=5)
    assert flags == [
        {
            "kind": "self_disagreement",
            "comparison": 2,
            "label": "self (logged configuration)",
            "agreement": pytest.approx(0.98),
            "disagreeing": 1,
            "message": "self-replay agreement 98.0% (< 100%)",
        }
    ]


def test_new_category_only_against_history() -> None:
    kv = metrics(50, 4, category="kv_dependent", c_fixes=0)
    assert detect_drift(kv, [], ear_drop_points=50) == []  # the first run has no "before"
    history = [metrics(50, 4, category="head_reachable")]
    new = [f for f in detect_drift(kv, history, ear_drop_points=50) if f["kind"] == "new_category"]
    # kv_dependent appears in FP16 and (unrepaired) in FP16 + C for the first time.
    assert [(f["comparison"], f["category"], f["count"]) for f in new] == [
        (0, "kv_dependent", 4),
        (1, "kv_dependent", 4),
    ]
    # Once seen, no longer new.
    assert not [
        f
        for f in detect_drift(kv, [*history, kv], ear_drop_points=50)
        if f["kind"] == "new_category"
    ]
