"""Issue 34: a null that backs its promise at the budgets used. The vectorised group draws
are the groups the per-draw loop drew (same distribution, every group exactly its budget), fast
enough for 1,000 draws of 131,072 tokens; a calibration stores how far its null reaches, and a
group beyond it is judged at the reach's threshold and says so. Pure: synthetic deficits."""

from __future__ import annotations

import json
import time

import numpy as np

from replay_audit.stats.verification import (
    BUDGETS,
    Calibration,
    calibrate,
    draw_group_scores,
    draw_groups,
    null_reach,
    verdict,
)
from tests.stats.verification_inputs import CLAIM, PLATFORM


def _loop_draws(
    scores: list[np.ndarray], budget: int, draws: int, rng: np.random.Generator
) -> np.ndarray:
    """The per-draw loop `draw_group_scores` replaced (issue 23's), the reference."""
    sums = [np.concatenate([[0.0], np.cumsum(s)]) for s in scores if len(s)]
    k = len(sums)
    out = np.empty(draws)
    for d in range(draws):
        population = rng.integers(k, size=k)
        left, total = budget, 0.0
        while left > 0:
            c = sums[int(population[rng.integers(k)])]
            take = min(left, c.size - 1)
            total += c[take]
            left -= take
        out[d] = total / budget
    return out


def _traces(rng: np.random.Generator, n: int, p: float, size: float = 1.0) -> list[np.ndarray]:
    """n traces of 5 to 60 tokens, each flipping at its own rate around p."""
    return [
        np.where(rng.random(int(rng.integers(5, 61))) < rng.beta(1.0, 1.0 / p - 1.0), size, 0.0)
        for _ in range(n)
    ]


def test_every_group_has_exactly_its_budget_and_sums_whole_traces_then_a_cut_one() -> None:
    # Two traces whose tokens are distinct: every group's sum names the traces it took.
    x = [np.arange(5.0), np.arange(3.0) + 10.0]
    possible_7 = {(10 + 21) / 7, (33 + 6) / 7, (10 + 1) / 7, (33 + 33 + 10) / 7, (66 + 0) / 7}
    drawn = draw_group_scores(x, 7, 400, np.random.default_rng(0))
    assert set(np.round(drawn, 9)) <= {round(v, 9) for v in possible_7}
    assert len(set(np.round(drawn, 9))) >= 4  # not one group over and over
    ones = [np.ones(7), np.ones(3), np.ones(1)]
    for budget in (1, 2, 3, 50, 1000):
        assert (draw_group_scores(ones, budget, 50, np.random.default_rng(1)) == 1.0).all()


def test_the_vectorised_draws_are_distributed_as_the_loop_drew_them() -> None:
    rng = np.random.default_rng(2)
    scores = _traces(rng, 40, 0.05)
    for budget in (64, 1024):
        new = draw_group_scores(scores, budget, 4000, np.random.default_rng(3))
        old = _loop_draws(scores, budget, 4000, np.random.default_rng(4))
        assert abs(new.mean() - old.mean()) < 4 * old.std() / np.sqrt(4000) * np.sqrt(2)
        assert 0.9 < new.std() / old.std() < 1.1, (budget, new.std(), old.std())
        for q in (0.5, 0.9, 0.99):
            assert abs(np.quantile(new, q) - np.quantile(old, q)) < 0.25 * old.std() + 1e-3


def test_several_statistics_score_the_same_groups() -> None:
    rng = np.random.default_rng(5)
    a = _traces(rng, 30, 0.1)
    doubled = draw_groups({"a": a, "twice": [2 * t for t in a]}, 500, 300, rng)
    assert np.allclose(doubled["twice"], 2 * doubled["a"])


def test_a_thousand_draws_of_131072_tokens_take_seconds() -> None:
    rng = np.random.default_rng(6)
    scores = _traces(rng, 200, 0.02)  # short traces: the most picks a group
    start = time.perf_counter()
    drawn = draw_group_scores(scores, 131072, 1000, rng)
    elapsed = time.perf_counter() - start
    assert drawn.shape == (1000,) and np.isfinite(drawn).all()
    assert elapsed < 20.0, elapsed  # the loop took minutes here
    assert BUDGETS[-1] >= 131072 and BUDGETS[-1] >= 100_000


def test_the_reach_is_the_largest_budget_every_variation_holds() -> None:
    rng = np.random.default_rng(7)
    null = {"small": _traces(rng, 10, 0.02), "large": _traces(rng, 80, 0.02)}
    least = min(sum(len(t) for t in v) for v in null.values())
    cal = calibrate(null, [], weights_sha256="x", claim=CLAIM, platform=PLATFORM, draws=100)
    assert cal.reach is not None and cal.reach <= least < 2 * cal.reach
    assert cal.reach == null_reach(cal.variations, BUDGETS)
    assert cal.backs(cal.reach) and not cal.backs(cal.reach + 1)
    # Stored before the reach was: read with the same rule on what was stored.
    old = cal.to_json()
    del old["reach"], old["rule"], old["decision"]
    again = Calibration.from_json(json.loads(json.dumps(old)))
    assert again.reach == cal.reach and again.decision == "outside_tie_band"
    assert Calibration.from_json(json.loads(json.dumps(cal.to_json()))) == cal


def test_a_group_beyond_the_reach_says_so_and_is_judged_at_the_reach() -> None:
    rng = np.random.default_rng(8)
    null = {"v": _traces(rng, 20, 0.02)}
    alt = _traces(rng, 20, 0.3, size=30.0)
    cal = calibrate(null, alt, weights_sha256="x", claim=CLAIM, platform=PLATFORM, draws=200)
    assert cal.reach is not None
    inside = verdict(_traces(rng, 5, 0.02)[:5], cal)
    assert inside.tokens <= cal.reach and not inside.beyond_null_reach
    benign = _traces(rng, 400, 0.02)
    big = verdict(benign, cal)
    assert big.tokens > cal.reach
    assert big.beyond_null_reach and big.null_reach == cal.reach
    assert big.budget == cal.at(cal.reach).tokens  # the reach's threshold, not a larger budget's
    expected = (
        cal.rule_at(cal.reach).thresholds[big.statistic]
        if big.decision != "outside_tie_band"
        else cal.at(cal.reach, big.statistic).threshold
    )
    assert big.threshold == expected
    # Beyond the reach an honest group is still judged, never silently: the field says so.
    assert big.verdict in ("consistent", "inconsistent", "insufficient")
    tampered = verdict(_traces(rng, 400, 0.3, size=30.0), cal)
    assert tampered.verdict == "inconsistent" and tampered.beyond_null_reach
