"""Issue 34: the combined decision rule (the tie band or the mean deficit, each over its own
threshold set at half the false-alarm rate, the highest of the benign variations' quantiles)
keeps the false-alarm rate by construction on every variation, records which statistic
decided, and sees a rounding-level change (flips inside the tie band) that the tie band alone
cannot. Pure: synthetic deficits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from replay_audit.stats.verification import (
    RULE_STATISTICS,
    Calibration,
    calibrate,
    draw_groups,
    verdict,
)
from tests.stats.verification_inputs import CLAIM, PLATFORM

BUDGETS = (64, 256, 1024, 4096)


def _traces(
    rng: np.random.Generator, n: int, p_flip: float, p_big: float = 0.0, ulps: float = 1.0
) -> list[np.ndarray]:
    """n traces of 48 tokens: each flips at its own rate around p_flip by `ulps` (inside the
    tie band at 1 to 3), and a few big deficits (20 ulps) at p_big."""
    out = []
    for _ in range(n):
        rate = rng.beta(2.0, 2.0 / p_flip - 2.0)
        u = np.where(rng.random(48) < rate, ulps, 0.0)
        out.append(np.where(rng.random(48) < p_big, 20.0, u))
    return out


@pytest.fixture(scope="module")
def null() -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return {
        "quiet": _traces(rng, 300, 0.02),
        "noisy": _traces(rng, 300, 0.04, p_big=0.002),
        "rounder": _traces(rng, 300, 0.03, ulps=2.0),
    }


@pytest.fixture(scope="module")
def cal(null: dict[str, list[np.ndarray]]) -> Calibration:
    rng = np.random.default_rng(1)
    alt = _traces(rng, 200, 0.1, p_big=0.05)
    c = calibrate(
        null, alt, weights_sha256="x", claim=CLAIM, platform=PLATFORM, budgets=BUDGETS, draws=600
    )
    return replace(c, decision="tie_band_or_mean_deficit")


def test_each_threshold_is_at_half_the_rate_and_the_rule_keeps_the_rate_on_every_variation(
    cal: Calibration,
) -> None:
    assert [r.tokens for r in cal.rule] == list(BUDGETS)
    for r in cal.rule:
        assert set(r.thresholds) == set(RULE_STATISTICS)
        # Measured on the null's own groups, variation by variation: the union bound holds.
        assert r.false_alarm <= cal.false_alarm_rate
        for stat in RULE_STATISTICS:
            single = next(b for b in cal.budgets[stat] if b.tokens == r.tokens)
            assert r.thresholds[stat] >= single.threshold  # a stricter quantile
            assert r.set_by[stat] in {"quiet", "noisy", "rounder"}


def test_fresh_benign_groups_trip_the_rule_at_most_at_the_rate(
    null: dict[str, list[np.ndarray]], cal: Calibration
) -> None:
    """Groups of other prompts of each benign variation (the same generating process, traces
    the null never saw) raise the promised share of false alarms, within sampling error."""
    rng = np.random.default_rng(2)
    fresh = {
        "quiet": _traces(rng, 2000, 0.02),
        "noisy": _traces(rng, 2000, 0.04, p_big=0.002),
        "rounder": _traces(rng, 2000, 0.03, ulps=2.0),
    }
    for name, traces in fresh.items():
        scores = {s: [cal.scorer.scores(u, s) for u in traces] for s in RULE_STATISTICS}
        for r in cal.rule:
            groups = draw_groups(scores, r.tokens, 2000, rng)
            tripped = np.logical_or.reduce(
                [groups[s] > r.thresholds[s] for s in RULE_STATISTICS]
            ).mean()
            # 1% promised; 2,000 groups of a 300-trace null: its own uncertainty and ours.
            assert tripped <= 0.03, (name, r.tokens, tripped)


def test_the_rule_sees_a_rounding_level_change_the_tie_band_cannot(cal: Calibration) -> None:
    """A provider whose flips are all inside the tie band (2 ulps) but three times as frequent:
    the tie band scores it as the null; the mean deficit decides, and says so."""
    rng = np.random.default_rng(3)
    rounding = _traces(rng, 120, 0.12, ulps=2.0)  # 5,760 tokens
    combined = verdict(rounding, cal)
    assert combined.verdict == "inconsistent"
    assert combined.decided_by == "mean_deficit_ulps" and combined.statistic == "mean_deficit_ulps"
    assert combined.decision == "tie_band_or_mean_deficit"
    assert combined.score > combined.threshold
    tie_band = verdict(rounding, replace(cal, decision="outside_tie_band"))
    assert tie_band.verdict != "inconsistent" and tie_band.decided_by is None


def test_an_honest_group_is_consistent_and_nothing_decided(cal: Calibration) -> None:
    rng = np.random.default_rng(4)
    honest = verdict(_traces(rng, 100, 0.02), cal)
    assert honest.verdict == "consistent" and honest.decided_by is None
    tampered = verdict(_traces(rng, 60, 0.1, p_big=0.05), cal)
    assert tampered.verdict == "inconsistent" and tampered.decided_by in RULE_STATISTICS


def test_a_calibration_without_the_rule_decides_by_the_tie_band(cal: Calibration) -> None:
    """Stored before the rule was measured: its verdicts are the tie band's, as before."""
    old = replace(cal, rule=[])
    v = verdict(_traces(np.random.default_rng(5), 60, 0.1, p_big=0.05), old)
    assert v.decision == "outside_tie_band" and v.statistic == "outside_tie_band"
    assert old.tokens_needed() == old.tokens_needed("outside_tie_band")
