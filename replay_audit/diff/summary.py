"""Summary of a set of replay results (the JSON dicts of `TraceReplay.to_dict()`). Pure.

n             number of results
ear           exact agreement rate: exact matches / n
trigger_rate  gate firings over all replayed steps, pooled across traces
mean_gap      mean margin over all replayed steps, pooled (weighted by steps)
t_star        min / median / max of the first divergence step over divergent traces
categories    count per category (all four always present)
sar           semantic agreement rate over results that carry an extraction (None if none)
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from replay_audit.diff.category import CATEGORIES


def summarize(results: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Aggregate replay results into the numbers `replay-audit replay` prints."""
    rows = list(results)
    n = len(rows)
    exact = sum(1 for r in rows if r["exact_match"])
    steps = sum(int(r.get("steps") or 0) for r in rows)
    triggers = sum(int(r.get("gate_triggers") or 0) for r in rows)
    with_gap = [r for r in rows if r.get("mean_gap") is not None]
    gap_weighted = sum(float(r["mean_gap"]) * int(r.get("steps") or 0) for r in with_gap)
    gap_steps = sum(int(r.get("steps") or 0) for r in with_gap)
    t_stars = [
        int(r["first_divergence_step"]) for r in rows if r["first_divergence_step"] is not None
    ]
    categories = dict.fromkeys(CATEGORIES, 0)
    for r in rows:
        categories[r["category"]] += 1
    semantic = [r["semantic"] for r in rows if r.get("semantic")]
    return {
        "n": n,
        "exact": exact,
        "ear": exact / n if n else None,
        "steps": steps,
        "gate_triggers": triggers,
        "trigger_rate": triggers / steps if steps else None,
        "mean_gap": gap_weighted / gap_steps if gap_steps else None,
        "t_star": {
            "n": len(t_stars),
            "min": min(t_stars) if t_stars else None,
            "median": statistics.median(t_stars) if t_stars else None,
            "max": max(t_stars) if t_stars else None,
        },
        "categories": categories,
        "sar": sum(1 for s in semantic if s["agree"]) / len(semantic) if semantic else None,
    }
