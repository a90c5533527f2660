"""benchmarks/e2e_audit.py's summary of a run's report: comparison 0's figures, its results
by baseline and the reproduction check's rate, so an audit's e2e.json says how many traces the
check did not reproduce (each judged against its replay, the costlier path in scan-then-decode)."""

from __future__ import annotations

from benchmarks import e2e_audit


def test_a_runs_summary_keeps_its_baselines_and_the_checks_reproduction_rate() -> None:
    rate = {"successes": 90, "n": 100, "estimate": 0.9, "low": 0.83, "high": 0.95}
    report = {
        "comparisons": [
            {
                "label": "logged vs fp16",
                "n": 100,
                "ear": {"n": 100},
                "baselines": {"logged": 90, "reproduced": 10},
                "lifts": [],
            },
            {"label": "logged vs self", "n": 100},
        ],
        "engine_reproduction": {"comparison": 1, "reproduced": rate, "n": 100},
    }
    summary = e2e_audit._comparison_summary(report)
    assert summary["baselines"] == {"logged": 90, "reproduced": 10}
    assert summary["engine_reproduced"] == rate
    assert summary["label"] == "logged vs fp16" and "lifts" not in summary
    assert "engine_reproduced" not in e2e_audit._comparison_summary(
        {**report, "engine_reproduction": None}
    )
    assert e2e_audit._comparison_summary({"comparisons": []}) == {}
