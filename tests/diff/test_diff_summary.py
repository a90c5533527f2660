"""The summary of a set of results."""

from __future__ import annotations

from replay_audit.diff import summarize


def _r(
    exact: bool, t: int | None, cat: str, steps: int, trig: int, gap: float
) -> dict[str, object]:
    return {
        "exact_match": exact,
        "first_divergence_step": t,
        "category": cat,
        "steps": steps,
        "gate_triggers": trig,
        "mean_gap": gap,
        "semantic": None,
    }


def test_summarize_pools_steps_and_counts_categories() -> None:
    rows = [
        _r(True, None, "agreed", 10, 0, 2.0),
        _r(False, 3, "head_reachable", 20, 2, 1.0),
        _r(False, 9, "body_dominated", 10, 0, 4.0),
    ]
    s = summarize(rows)
    assert s["n"] == 3 and s["exact"] == 1 and s["ear"] == 1 / 3
    assert s["trigger_rate"] == 2 / 40
    assert s["mean_gap"] == (20 + 20 + 40) / 40
    assert s["t_star"] == {"n": 2, "min": 3, "median": 6.0, "max": 9}
    assert s["categories"] == {
        "agreed": 1,
        "head_reachable": 1,
        "kv_dependent": 0,
        "body_dominated": 1,
    }
    assert s["sar"] is None


def test_summarize_empty() -> None:
    s = summarize([])
    assert s["n"] == 0 and s["ear"] is None and s["t_star"]["min"] is None
