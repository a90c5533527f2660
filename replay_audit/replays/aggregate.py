"""A finished run's aggregate, from its per-trace result rows. Pure (stdlib, numpy, stats):
the same function serves the API's `aggregate`, the CLI summary and the reports, so the numbers
can never disagree with the rows they come from.

Per comparison: n, ok, failed, EAR (Wilson 95%), SAR where answers were extracted, trigger rate
(gate firings over all replayed steps), mean gap (mean margin over all replayed steps), t*
distribution, margin at t* (absolute and ulps, both arms), length differences and the category
breakdown. Lifts: every comparison against comparison 0 (the baseline), paired on the traces
where both succeeded: EAR difference with a seeded paired-bootstrap interval, the exact McNemar
test, and the traces the later comparison fixed and broke.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from replay_audit.stats import (
    distribution,
    flip_indices,
    mcnemar_exact,
    paired_bootstrap_lift,
    proportion,
)

CATEGORIES = ("agreed", "head_reachable", "kv_dependent", "body_dominated")
#: Resamples of the paired bootstrap behind each lift interval (seeded: reproducible).
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


def _dist(values: Sequence[float | int | None]) -> dict[str, Any] | None:
    xs = [float(v) for v in values if v is not None]
    return asdict(distribution(xs)) if xs else None


def _prop(successes: int, n: int) -> dict[str, Any]:
    p = proportion(successes, n)
    return {
        "successes": p.successes,
        "n": p.n,
        "estimate": p.estimate,
        "low": p.interval.low,
        "high": p.interval.high,
    }


def summarise(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The summary of one comparison's result rows."""
    ok = [r for r in rows if r["status"] == "ok"]
    diverged = [r for r in ok if not r["exact_match"]]
    steps = sum(int(r["n_steps"] or 0) for r in ok)
    triggers = sum(int(r["gate_triggers"] or 0) for r in ok)
    gap_sum = sum(
        float(r["mean_gap"]) * int(r["n_steps"] or 0) for r in ok if r["mean_gap"] is not None
    )
    semantic = [r["semantic_agree"] for r in ok if r.get("semantic_agree") is not None]
    cats = Counter(r["category"] for r in ok)
    return {
        "n": len(rows),
        "ok": len(ok),
        "failed": len(rows) - len(ok),
        "ear": _prop(sum(1 for r in ok if r["exact_match"]), len(ok)),
        "sar": _prop(sum(1 for s in semantic if s), len(semantic)) if semantic else None,
        "steps": steps,
        "gate_triggers": triggers,
        "trigger_rate": triggers / steps if steps else None,
        "mean_gap": gap_sum / steps if steps else None,
        "first_divergence_step": _dist([r["first_divergence_step"] for r in diverged]),
        "margin_at_divergence": {
            "replay": _dist([r["margin_replay"] for r in diverged]),
            "replay_ulps": _dist([r["margin_replay_ulps"] for r in diverged]),
            "logged": _dist([r["margin_logged"] for r in diverged]),
            "logged_ulps": _dist([r["margin_logged_ulps"] for r in diverged]),
            "ties": sum(
                1 for r in diverged if r["margin_replay"] == 0.0 or r["margin_logged"] == 0.0
            ),
        },
        "length_difference": _dist([r["length_difference"] for r in diverged]),
        "categories": {c: cats.get(c, 0) for c in CATEGORIES},
    }


def lift(
    baseline: Mapping[int, Mapping[str, Any]],
    treated: Mapping[int, Mapping[str, Any]],
    trace_public_ids: Mapping[int, str],
) -> dict[str, Any] | None:
    """EAR(treated) - EAR(baseline) on the traces where both succeeded."""
    common = sorted(
        t
        for t in baseline.keys() & treated.keys()
        if baseline[t]["status"] == "ok" and treated[t]["status"] == "ok"
    )
    if not common:
        return None
    b = [bool(baseline[t]["exact_match"]) for t in common]
    a = [bool(treated[t]["exact_match"]) for t in common]
    res = paired_bootstrap_lift(b, a, resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED)
    flips = flip_indices(b, a)
    test = mcnemar_exact(res.broke, res.fixed)
    return {
        "n": res.n,
        "lift": res.lift,
        "low": res.low,
        "high": res.high,
        "confidence": res.confidence,
        "fixed": res.fixed,
        "broke": res.broke,
        "mcnemar_p": test.p_value,
        "fixed_trace_ids": [trace_public_ids[common[i]] for i in flips.fixed],
        "broke_trace_ids": [trace_public_ids[common[i]] for i in flips.broke],
    }


def aggregate_run(
    rows: Sequence[Mapping[str, Any]],
    comparisons: Sequence[Mapping[str, Any]],
    targets: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """`rows` carry the result columns plus `trace_id` and `public_id` (the trace's). A
    comparison with a self-replay target (`{"self": true}`) is a reproducibility check, not a
    treatment: it gets no lift."""
    by_comp: dict[int, dict[int, Mapping[str, Any]]] = defaultdict(dict)
    public: dict[int, str] = {}
    for r in rows:
        by_comp[int(r["comparison"])][int(r["trace_id"])] = r
        public[int(r["trace_id"])] = str(r["public_id"])
    out: dict[str, Any] = {"comparisons": [], "lifts": []}
    for c in comparisons:
        idx = int(c["index"])
        out["comparisons"].append(
            {"index": idx, "a": c["a"], "b": c["b"], **summarise(list(by_comp[idx].values()))}
        )
    for c in comparisons[1:]:
        idx = int(c["index"])
        if isinstance(c["b"], int) and c["b"] < len(targets) and targets[c["b"]].get("self"):
            continue
        result = lift(by_comp[0], by_comp[idx], public)
        if result is not None:
            out["lifts"].append({"baseline": 0, "treated": idx, **result})
    return out
