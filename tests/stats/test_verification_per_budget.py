"""Issue 34: the decision per budget. A calibration chooses, budget by budget, what its verdicts
use (the tie band, at its rare-event floor or not, the combined rule, the mean deficit) by a
held-out split of the null's traces, so that neither known failure of a single statistic
reaches the verdicts:

- SmolLM2 on an H200: a few out-of-band tokens, clustered in a few traces; the tie band's
  threshold at large budgets rests on them and honest groups trip it (5.5-7.2% held out at
  65,536-131,072 tokens), while the mean deficit holds;
- the trained 1.07 B: no out-of-band token, but rounding flips heavy-tailed across traces and a
  small variation (bf16 b8, 40 prompts): the mean deficit tripped 2.6% of its held-out groups
  at 64 tokens, while the tie band held.

Both are reproduced on synthetic populations, and the chosen decisions are judged on fresh
honest groups of distinct traces of the same population (as a provider's come). Pure."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from replay_audit.stats.verification import (
    CANDIDATES,
    Calibration,
    Ulps,
    allowance,
    calibrate,
    choose,
    draw_groups,
    flags,
    verdict,
)
from tests.stats.verification_inputs import CLAIM, PLATFORM

L = 100  # tokens a trace
FRESH = 3000  # fresh honest groups a budget and variation


def _rounding(rng: np.random.Generator, rate: float) -> Ulps:
    """A trace's rounding-level flips (1 to 3 ulps, inside the tie band) at `rate` a token."""
    return np.where(rng.random(L) < rate, rng.choice([1.0, 1.0, 2.0, 3.0], L), 0.0)


def _smol(rng: np.random.Generator, n: int, clusters: dict[int, int] | None = None) -> list[Ulps]:
    """SmolLM2-like traces: rounding flips at a rate of each trace's own; one trace in 1,500
    holds a cluster of 1 to 3 tokens outside the tie band (5 to 8 ulps). `clusters`: exactly
    these (trace -> its cluster's tokens): a null's few, on the prompts that go off in every
    variation (SmolLM2's 1.6 M benign tokens held 8 such tokens, in a few traces)."""
    out = [_rounding(rng, r) for r in rng.beta(0.5, 150, n)]
    if clusters is None:
        hit = np.flatnonzero(rng.random(n) < 1 / 1500)
        sizes = 1 + rng.binomial(2, 0.5, hit.size)
        clusters = dict(zip(hit.tolist(), sizes.tolist(), strict=True))
    for i, k in clusters.items():
        out[i][rng.choice(L, k, replace=False)] = rng.integers(5, 9, k)
    return out


def _llama(
    rng: np.random.Generator, n: int, heavy: float, planted: int | None = None
) -> list[Ulps]:
    """1.07 B-like traces: no token outside the tie band; most traces flip rarely, a share
    `heavy` of them often (3-25% of their tokens), so the mean deficit's small groups are
    heavy-tailed. `planted`: exactly that many heavy traces."""
    is_heavy = rng.random(n) < heavy
    if planted is not None:
        is_heavy = np.isin(np.arange(n), rng.choice(n, planted, replace=False))
    rates = np.where(is_heavy, rng.uniform(0.03, 0.25, n), rng.beta(0.3, 300, n))
    return [_rounding(rng, r) for r in rates]


def _four_bit(rng: np.random.Generator, n: int, big: float, small: float) -> list[Ulps]:
    """A 4-bit-like provider: tokens far outside the band at `big`, in-band flips at `small`."""
    out = []
    for _ in range(n):
        u = np.where(rng.random(L) < big, rng.integers(5, 40, L).astype(np.float64), 0.0)
        out.append(np.where((u == 0) & (rng.random(L) < small), rng.choice([2.0, 3.0, 4.0], L), u))
    return out


def _fresh_false_alarms(
    cal: Calibration, population: dict[str, list[Ulps]], budget: int, thresholds: dict[str, float]
) -> float:
    """The worst variation's share of fresh honest groups of `budget` distinct population
    traces over `thresholds`."""
    rng = np.random.default_rng(budget)
    worst = 0.0
    for traces in population.values():
        scores = {s: [cal.scorer.scores(u, s) for u in traces] for s in thresholds}
        groups = draw_groups(scores, budget, FRESH, rng, distinct=True)
        worst = max(worst, float(flags(thresholds, groups).mean()))  # type: ignore[arg-type]
    return worst


def _fresh_single(
    cal: Calibration, population: dict[str, list[Ulps]], statistic: str, budgets: list[int]
) -> list[float]:
    """`_fresh_false_alarms` of one statistic alone at its threshold, per budget."""
    out = []
    for n in budgets:
        row = next(b for b in cal.budgets[statistic] if b.tokens == n)
        out.append(_fresh_false_alarms(cal, population, n, {statistic: row.threshold}))
    return out


SMOL_BUDGETS = (64, 512, 4096, 16384, 65536)


@pytest.fixture(scope="module")
def smol() -> tuple[Calibration, dict[str, list[Ulps]]]:
    rng = np.random.default_rng(0)
    off = {100: 3, 900: 1}  # the prompts that go off, the same in both variations
    null = {"bf16": _smol(rng, 1536, off), "bf16 eager": _smol(rng, 1536, off)}
    cal = calibrate(
        null,
        _four_bit(rng, 300, 0.06, 0.05),
        weights_sha256="x",
        claim=CLAIM,
        platform=PLATFORM,
        budgets=SMOL_BUDGETS,
    )
    population = {name: _smol(np.random.default_rng(10 + i), 8000) for i, name in enumerate(null)}
    return cal, population


@pytest.mark.slow
def test_rare_clustered_out_of_band_tokens_the_per_budget_choice_keeps_the_rate(
    smol: tuple[Calibration, dict[str, list[Ulps]]],
) -> None:
    cal, population = smol
    assert cal.decision == "per_budget"
    assert [c.tokens for c in cal.choices] == list(SMOL_BUDGETS)
    large = [c for c in cal.choices if c.tokens >= 4096]
    # The pathology, as the null's own held-out split sees it: the half without the prompt
    # that went off by 3 tokens sets the tie band's threshold, and the other half's groups
    # holding that trace trip it, the more often the larger the group. The mean deficit, which
    # averages every token's rounding, holds on fresh groups.
    assert all(c.held_out_false_alarm["outside_tie_band"] > c.allowance for c in large)
    mean = _fresh_single(cal, population, "mean_deficit_ulps", [c.tokens for c in large])
    assert max(mean) <= large[0].allowance, mean
    # The choice: never the tie band alone where it failed, and fresh honest groups trip what
    # was chosen at most at the promised rate plus the allowance, at every budget.
    for c in cal.choices:
        assert c.decision in CANDIDATES
        if c in large:
            assert c.decision != "outside_tie_band"
        decided, thresholds = cal.decision_at(c.tokens)
        assert (decided, thresholds) == (c.decision, c.thresholds)
        fresh = _fresh_false_alarms(cal, population, c.tokens, thresholds)
        assert fresh <= c.allowance, (c.tokens, c.decision, fresh)


def test_rare_clustered_out_of_band_tokens_verdicts_say_what_decided(
    smol: tuple[Calibration, dict[str, list[Ulps]]],
) -> None:
    cal, population = smol
    rng = np.random.default_rng(5)
    needed = cal.tokens_needed()
    assert needed is not None and needed <= 512
    honest = verdict(population["bf16"][:200], cal)  # 20,000 tokens: judged at 16,384
    chosen = next(c for c in cal.choices if c.tokens == 16384)
    assert honest.verdict == "consistent" and honest.budget == 16384
    assert honest.decision == chosen.decision and honest.decided_by is None
    tampered = verdict(_four_bit(rng, 6, 0.06, 0.05), cal)  # 600 tokens
    assert tampered.verdict == "inconsistent"
    assert tampered.decision == next(c for c in cal.choices if c.tokens == 512).decision
    assert tampered.decided_by is not None and tampered.score > tampered.threshold
    again = Calibration.from_json(json.loads(json.dumps(cal.to_json())))
    assert again == cal


LLAMA_BUDGETS = (16, 32, 64, 128, 256, 1024)


@pytest.fixture(scope="module")
def llama() -> tuple[Calibration, dict[str, list[Ulps]]]:
    rng = np.random.default_rng(1)
    heavy = {"bf16 b256": 0.01, "bf16 b8": 0.05}
    null = {"bf16 b256": _llama(rng, 1536, 0.01), "bf16 b8": _llama(rng, 40, 0.05, planted=1)}
    cal = calibrate(
        null,
        _four_bit(rng, 300, 0.02, 0.12),
        weights_sha256="x",
        claim=CLAIM,
        platform=PLATFORM,
        budgets=LLAMA_BUDGETS,
    )
    population = {
        name: _llama(np.random.default_rng(20 + i), 3000, heavy[name])
        for i, name in enumerate(null)
    }
    return cal, population


@pytest.mark.slow
def test_a_heavy_tailed_mean_deficit_and_a_small_variation_the_choice_keeps_the_rate(
    llama: tuple[Calibration, dict[str, list[Ulps]]],
) -> None:
    cal, population = llama
    # The pathology: the mean deficit alone trips fresh groups of the small variation at small
    # budgets (its 40 traces cannot set a 99th percentile), the tie band never does.
    mean = _fresh_single(cal, population, "mean_deficit_ulps", [16, 32, 64])
    assert max(mean) > 0.02, mean
    # The small variation's held-out half holds 20 traces: fewer disjoint groups than one false
    # alarm at 1% needs, too few to show the mean deficit holding (its own held-out groups may
    # not show it failing either), so the tie band, which did not fail, keeps deciding where
    # the null backs its threshold: up to the budget where 1,536 traces with no out-of-band
    # token (3 / 1,536 such traces at the upper bound) would trip more than 1% of groups at a
    # threshold of 0 (the rare-event guard: 1,024 tokens here).
    assert not any(c.trusted for c in cal.choices)
    for c in cal.choices:
        assert c.supply <= 20 and c.passed and c.rare_event_guard is not None
        backed = c.held_out_false_alarm["outside_tie_band"] <= c.allowance and (
            cal.budgets["outside_tie_band"][LLAMA_BUDGETS.index(c.tokens)].threshold
            >= c.rare_event_guard
        )
        assert (c.decision == "outside_tie_band") == backed, c
        assert backed == (c.tokens <= 256), c
        fresh = _fresh_false_alarms(cal, population, c.tokens, c.thresholds)
        assert fresh <= c.allowance, (c.tokens, c.decision, fresh)
    # Still decides: a 4-bit-like provider is inconsistent, an honest group consistent.
    needed = cal.tokens_needed()
    assert needed is not None and needed <= 256
    rng = np.random.default_rng(6)
    assert verdict(_four_bit(rng, 3, 0.02, 0.12), cal).verdict == "inconsistent"
    honest = verdict(population["bf16 b256"][:12], cal)
    assert honest.verdict == "consistent" and honest.decision == cal.decision_at(1200)[0]


def test_the_choice_takes_the_most_powerful_that_keeps_the_rate_where_the_halves_can_say() -> None:
    thresholds: dict[Any, dict[str, float]] = {c: {"outside_tie_band": 0.0} for c in CANDIDATES}
    powers: dict[Any, float | None] = {
        "outside_tie_band": 0.6,
        "outside_tie_band_floored": 0.5,
        "floored_or_mean_deficit": 0.9,
        "mean_deficit_ulps": 0.95,
    }
    held: dict[Any, float] = {
        "outside_tie_band": 0.0,
        "outside_tie_band_floored": 0.0,
        "floored_or_mean_deficit": 0.01,
        "mean_deficit_ulps": 0.03,
    }
    limit = allowance(0.01, 1000)
    assert limit == 0.015  # 15 of 1,000 groups at 1% (the binomial's 95th percentile)
    trusted = choose(64, thresholds, powers, held, 0.01, limit, supply=500.0)
    assert trusted.decision == "floored_or_mean_deficit" and trusted.passed and trusted.trusted
    # Too few disjoint held-out groups to show a candidate holding: the tie band, which did not
    # fail; where it failed, the most powerful of the others that did not.
    few = choose(64, thresholds, powers, held, 0.01, limit, supply=50.0)
    assert few.decision == "outside_tie_band" and not few.trusted and few.passed
    failing = held | {"outside_tie_band": 0.05}
    few = choose(64, thresholds, powers, failing, 0.01, limit, supply=50.0)
    assert few.decision == "floored_or_mean_deficit" and not few.trusted
    # None keeps the rate: the most conservative, and it says so.
    worse = {c: 0.02 + 0.01 * i for i, c in enumerate(reversed(CANDIDATES))}
    failed = choose(64, thresholds, powers, worse, 0.01, limit, supply=500.0)
    assert failed.decision == "mean_deficit_ulps" and not failed.passed


def test_version_4_guard_power_curve_monotone_and_unmeasured_budgets() -> None:
    """`choose`'s rules of calibration version 4, one at a time."""
    thresholds: dict[Any, dict[str, float]] = {c: {"outside_tie_band": 0.0} for c in CANDIDATES}
    ones: dict[Any, float | None] = dict.fromkeys(CANDIDATES, 1.0)
    held: dict[Any, float] = dict.fromkeys(CANDIDATES, 0.0)
    limit = allowance(0.01, 1000)
    # The rare-event guard: the plain tie band at a threshold of 0 where the null's rare events
    # allow more is not eligible, however well it did held out; a threshold at the guard is.
    guarded = choose(512, thresholds, ones, held, 0.01, limit, 50.0, guard=1 / 512)
    assert guarded.decision != "outside_tie_band" and guarded.rare_event_guard == 1 / 512
    at = thresholds | {"outside_tie_band": {"outside_tie_band": 1 / 512}}
    assert choose(512, at, ones, held, 0.01, limit, 50.0, guard=1 / 512).decision == (
        "outside_tie_band"
    )
    # Every power 1.0 (the 4-bit alternative at a large budget): the power curve decides, then
    # fewer held-out false alarms, then the order (version 3 took the floored tie band here).
    curve: dict[Any, float] = {
        "outside_tie_band": 0.9,
        "outside_tie_band_floored": 0.7,
        "floored_or_mean_deficit": 0.93,
        "mean_deficit_ulps": 0.95,
    }
    assert choose(4096, thresholds, ones, held, 0.01, limit, 500.0).decision == CANDIDATES[0]
    tied = choose(4096, thresholds, ones, held, 0.01, limit, 500.0, curve=curve)
    assert tied.decision == "mean_deficit_ulps"
    # Monotone: where the previous budget's choice still passes, nothing weaker is taken, even
    # the tie band where the split is untrusted; where it fails, the rule is the usual one.
    after = choose(
        4096, thresholds, ones, held, 0.01, limit, 50.0, curve=curve, previous="mean_deficit_ulps"
    )
    assert after.decision == "mean_deficit_ulps"
    mean_fails = held | {"mean_deficit_ulps": 0.05}
    after = choose(
        4096,
        thresholds,
        ones,
        mean_fails,
        0.01,
        limit,
        50.0,
        curve=curve,
        previous="mean_deficit_ulps",
    )
    assert after.decision == "outside_tie_band"
    # A budget no held-out half holds: the budget below's decision carries on, whatever the
    # bootstrap's guess at this budget says.
    carried = choose(
        131072,
        thresholds,
        ones,
        mean_fails,
        0.01,
        limit,
        0.5,
        curve=curve,
        previous="mean_deficit_ulps",
        measured=False,
    )
    assert carried.decision == "mean_deficit_ulps" and not carried.passed


def test_groups_of_distinct_traces_never_repeat_one() -> None:
    """Per trace, a score of 1 on its own tokens: a group's score times the budget is how many
    of that trace's tokens it holds, at most the trace's length when no trace is drawn twice
    (the calibration's bootstrap draws exceed it)."""
    lengths = [7, 3, 12, 5, 9]
    scores = {
        f"t{i}": [np.full(m, 1.0 if j == i else 0.0) for j, m in enumerate(lengths)]
        for i in range(len(lengths))
    }
    rng = np.random.default_rng(0)
    distinct = draw_groups(scores, 30, 500, rng, distinct=True)
    held = np.stack([distinct[f"t{i}"] * 30 for i in range(len(lengths))])
    assert np.allclose(held.sum(axis=0), 30)  # exactly the budget's tokens
    assert (held <= np.asarray(lengths)[:, None] + 1e-9).all()
    drawn = draw_groups(scores, 30, 500, rng)
    resampled = np.stack([drawn[f"t{i}"] * 30 for i in range(len(lengths))])
    assert (resampled > np.asarray(lengths)[:, None] + 1e-9).any()
    with pytest.raises(ValueError):
        draw_groups(scores, 37, 5, rng, distinct=True)


def test_an_older_calibration_keeps_deciding_by_the_tie_band(
    smol: tuple[Calibration, dict[str, list[Ulps]]],
) -> None:
    cal, population = smol
    stored = cal.to_json()
    for key in ("choices", "decision"):
        del stored[key]
    old = Calibration.from_json({**stored, "version": 2})
    assert old.choices == [] and old.decision == "outside_tie_band"
    v = verdict(population["bf16"][:200], old)
    assert v.decision == "outside_tie_band" and v.statistic == "outside_tie_band"
    assert old.tokens_needed() == old.tokens_needed("outside_tie_band")
