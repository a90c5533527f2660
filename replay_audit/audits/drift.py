"""A scheduled run's trend point and its drift flags, from the replay run's statistics (the
`RunStatistics` every other surface reads).

Pure (no database): the evaluation job, the trend endpoint and the tests share it.

Trend point (one per audit run): per comparison its EAR (with the Wilson interval; in a
scan-then-decode run, the estimated EAR of all scanned traces and its interval, see
`stats/report.py`), trigger rate and category counts; and the schedule page's headline numbers:
    ear             EAR of the first comparison that is not the self-replay (the baseline)
    c_lift          the statistics' lift of the comparison whose target uses Intervention C over
                    the baseline, when the baseline has no intervention
    trigger_rate    the gate's trigger rate in that C comparison (else the baseline's)
    categories      the baseline's category mix
    self_agreement  EAR of the self-replay (`compare_with: "self"`), which must be 100%

Drift flags (stored with the run, POSTed to the webhook):
    ear_drop           a comparison's EAR more than `ear_drop_points` percentage points below
                       the mean of the same comparison over the previous TRAILING_RUNS runs
                       (needs at least MIN_TRAILING_RUNS of them)
    self_disagreement  the self-replay agreement below 100%
    new_category       a divergence category (not `agreed`) seen in a comparison for the first
                       time in this schedule's history (never on the first evaluated run)
Comparisons are matched across runs by index: a schedule's targets cannot be edited.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from replay_audit.replays.domain import RunTarget
from replay_audit.stats.report import RunStatistics

#: How many previous runs the EAR-drop rule averages over.
TRAILING_RUNS: Final = 7
#: Fewer previous runs than this and the EAR-drop rule stays silent (a mean of one or two
#: nights is noise, not a baseline).
MIN_TRAILING_RUNS: Final = 3

Metrics = dict[str, Any]
Flag = dict[str, Any]


def run_metrics(stats: RunStatistics, targets: Sequence[RunTarget]) -> Metrics:
    """The trend point of one finished replay run (see the module docstring)."""
    comps: list[dict[str, Any]] = []
    for c in stats.comparisons:
        b = targets[int(c.b)]
        is_self = b.is_self and c.a == "logged"
        label = (
            b.display_label()
            if c.a == "logged"
            else f"{targets[int(c.a)].display_label()} vs {b.display_label()}"
        )
        kind = b.target.intervention.kind if b.target is not None else "none"
        comps.append(
            {
                "index": c.index,
                "label": label,
                "self": is_self,
                "intervention": "none" if is_self else kind,
                "n": c.ok,
                "failed": c.failed,
                # A scan-then-decode run's EAR over all scanned traces (its decoded EAR leaves
                # out the traces only scanned): comparable with a decode run's.
                "ear": c.screening.ear.estimate if c.screening is not None else c.ear.estimate,
                "ear_low": c.screening.ear.low if c.screening is not None else c.ear.low,
                "ear_high": c.screening.ear.high if c.screening is not None else c.ear.high,
                "exact": c.ear.successes,
                "trigger_rate": c.trigger_rate,
                "categories": {k: v.successes for k, v in c.categories.items()},
            }
        )
    baseline = next((c for c in comps if not c["self"]), comps[0] if comps else None)
    treated = None
    c_lift = None
    if baseline is not None and baseline["intervention"] == "none":
        for lift in stats.lifts:
            cand = next((c for c in comps if c["index"] == lift.comparison_b), None)
            if lift.comparison_a == baseline["index"] and cand is not None:
                if cand["intervention"] != "C":
                    continue
                treated = cand
                c_lift = {
                    "lift": lift.lift,
                    "low": lift.low,
                    "high": lift.high,
                    "n": lift.n,
                    "fixed": lift.fixed,
                    "broke": lift.broke,
                    "comparison": cand["index"],
                }
                break
    self_comp = next((c for c in comps if c["self"]), None)
    trigger_source = treated or baseline
    return {
        "comparisons": comps,
        "ear": None if baseline is None else baseline["ear"],
        "ear_low": None if baseline is None else baseline["ear_low"],
        "ear_high": None if baseline is None else baseline["ear_high"],
        "baseline": None if baseline is None else baseline["index"],
        "c_lift": c_lift,
        "trigger_rate": None if trigger_source is None else trigger_source["trigger_rate"],
        "categories": {} if baseline is None else baseline["categories"],
        "self_agreement": None if self_comp is None else self_comp["ear"],
    }


def _ears(history: Iterable[Metrics], index: int) -> list[float]:
    out = []
    for h in history:
        for c in h.get("comparisons", []):
            if c["index"] == index and c.get("ear") is not None:
                out.append(float(c["ear"]))
    return out


def detect_drift(
    current: Metrics, history: Sequence[Metrics], *, ear_drop_points: float
) -> list[Flag]:
    """The drift flags of `current` given the schedule's earlier evaluated runs (oldest first)."""
    flags: list[Flag] = []
    trailing = history[-TRAILING_RUNS:]
    seen: set[tuple[int, str]] = {
        (int(c["index"]), cat)
        for h in history
        for c in h.get("comparisons", [])
        for cat, n in c.get("categories", {}).items()
        if n
    }
    for c in current.get("comparisons", []):
        idx, ear = int(c["index"]), c.get("ear")
        if c["self"]:
            if ear is not None and ear < 1.0:
                flags.append(
                    {
                        "kind": "self_disagreement",
                        "comparison": idx,
                        "label": c["label"],
                        "agreement": ear,
                        "disagreeing": int(c["n"]) - int(c.get("exact") or 0),
                        "message": f"self-replay agreement {100 * ear:.1f}% (< 100%)",
                    }
                )
        elif ear is not None:
            past = _ears(trailing, idx)
            if len(past) >= MIN_TRAILING_RUNS:
                mean = sum(past) / len(past)
                drop = 100 * (mean - ear)
                if drop > ear_drop_points:
                    flags.append(
                        {
                            "kind": "ear_drop",
                            "comparison": idx,
                            "label": c["label"],
                            "ear": ear,
                            "trailing_mean": mean,
                            "trailing_runs": len(past),
                            "drop_points": drop,
                            "message": (
                                f"{c['label']}: EAR {100 * ear:.1f}% is {drop:.1f} points below "
                                f"the {len(past)}-run mean {100 * mean:.1f}%"
                            ),
                        }
                    )
        if history:
            for cat, n in sorted(c.get("categories", {}).items()):
                if n and cat != "agreed" and (idx, cat) not in seen:
                    flags.append(
                        {
                            "kind": "new_category",
                            "comparison": idx,
                            "label": c["label"],
                            "category": cat,
                            "count": int(n),
                            "message": f"{c['label']}: first {cat} divergence for this schedule",
                        }
                    )
    return flags
