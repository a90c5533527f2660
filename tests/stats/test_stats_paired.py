"""Paired bootstrap lift, fixed / broke items, correctness flips. The reference for the bootstrap
is an explicit index-resampling bootstrap and normal theory (scipy.stats.norm)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from replay_audit.stats import (
    correctness_flips,
    flip_indices,
    paired_bootstrap_lift,
)

# Small hand-checkable example: items 2 and 5 fixed, 1 and 4 broke, 0 agrees in both, 3 in none.
BASELINE = [True, True, False, False, True, False]
TREATED = [True, False, True, False, False, True]


def test_fixed_and_broke_by_hand() -> None:
    result = paired_bootstrap_lift(BASELINE, TREATED, resamples=500)
    assert (result.fixed, result.broke, result.n) == (2, 2, 6)
    assert result.lift == 0.0
    flips = flip_indices(BASELINE, TREATED)
    assert flips.fixed == (2, 5)
    assert flips.broke == (1, 4)


def test_lift_is_the_difference_of_agreement_rates() -> None:
    baseline = [True, False, False, False, True, False, False, True]
    treated = [True, True, True, False, True, True, False, False]
    result = paired_bootstrap_lift(baseline, treated, resamples=200)
    assert result.lift == pytest.approx(np.mean(treated) - np.mean(baseline))
    assert (result.fixed, result.broke) == (3, 1)


def test_seeded_runs_are_reproducible() -> None:
    rng = np.random.default_rng(7)
    baseline = rng.random(500) < 0.35
    treated = rng.random(500) < 0.55
    first = paired_bootstrap_lift(baseline, treated, seed=3)
    again = paired_bootstrap_lift(baseline, treated, seed=3)
    assert first == again
    assert first.seed == 3 and first.resamples == 10_000


def test_identical_sequences_give_zero_lift_and_zero_width() -> None:
    flags = [True, False, True, True, False]
    result = paired_bootstrap_lift(flags, flags)
    assert (result.lift, result.low, result.high) == (0.0, 0.0, 0.0)
    assert (result.fixed, result.broke) == (0, 0)
    assert result.interval.width == 0.0


def test_all_fixed_gives_lift_one_with_degenerate_interval() -> None:
    result = paired_bootstrap_lift([False] * 20, [True] * 20)
    assert (result.lift, result.low, result.high, result.fixed) == (1.0, 1.0, 1.0, 20)


def _index_bootstrap(
    baseline: np.ndarray, treated: np.ndarray, resamples: int, confidence: float
) -> tuple[float, float]:
    """The textbook paired bootstrap: draw n item indices per resample."""
    rng = np.random.default_rng(12345)
    diff = treated.astype(np.int8) - baseline.astype(np.int8)
    lifts = np.empty(resamples)
    for start in range(0, resamples, 1000):
        idx = rng.integers(0, diff.size, size=(min(1000, resamples - start), diff.size))
        lifts[start : start + idx.shape[0]] = diff[idx].mean(axis=1)
    alpha = 1 - confidence
    low, high = np.quantile(lifts, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


@pytest.mark.parametrize("confidence", [0.90, 0.95])
def test_matches_index_resampling_bootstrap(confidence: float) -> None:
    rng = np.random.default_rng(1)
    n = 300
    baseline = rng.random(n) < 0.35
    treated = np.where(rng.random(n) < 0.3, ~baseline, baseline)
    ours = paired_bootstrap_lift(baseline, treated, resamples=20_000, confidence=confidence)
    low, high = _index_bootstrap(baseline, treated, 20_000, confidence)
    # Two independent Monte Carlo estimates of the same quantiles: the lift grid is 1/300 and
    # the quantiles' Monte Carlo error is about 0.002 here.
    assert ours.low == pytest.approx(low, abs=0.0075)
    assert ours.high == pytest.approx(high, abs=0.0075)


def test_large_sample_interval_matches_normal_theory() -> None:
    # 1,500 fixed, 500 broke of 10,000: the plug-in variance of the mean paired difference is
    # (pf + pb - (pf - pb)^2) / n, and the percentile interval is close to lift +/- z se.
    n, fixed, broke = 10_000, 1_500, 500
    baseline = np.zeros(n, dtype=bool)
    treated = np.zeros(n, dtype=bool)
    treated[:fixed] = True
    baseline[fixed : fixed + broke] = True
    result = paired_bootstrap_lift(baseline, treated, seed=11)
    pf, pb = fixed / n, broke / n
    se = math.sqrt((pf + pb - (pf - pb) ** 2) / n)
    z = float(sps.norm.ppf(0.975))
    assert result.lift == pytest.approx(0.1)
    assert result.high - result.lift == pytest.approx(z * se, rel=0.06)
    assert result.lift - result.low == pytest.approx(z * se, rel=0.06)


@settings(max_examples=60, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=400),
    seed=st.integers(0, 2**32),
    confidence=st.sampled_from([0.8, 0.9, 0.95, 0.99]),
)
def test_interval_properties(pairs: list[tuple[bool, bool]], seed: int, confidence: float) -> None:
    baseline = [a for a, _ in pairs]
    treated = [b for _, b in pairs]
    result = paired_bootstrap_lift(
        baseline, treated, resamples=2_000, seed=seed, confidence=confidence
    )
    n = len(pairs)
    assert -1.0 <= result.low <= result.lift <= result.high <= 1.0
    assert result.lift == pytest.approx(sum(treated) / n - sum(baseline) / n, abs=1e-12)
    fixed = sum(1 for a, b in pairs if b and not a)
    broke = sum(1 for a, b in pairs if a and not b)
    assert (result.fixed, result.broke, result.n) == (fixed, broke, n)
    # A resample only reuses the observed items: without broke items no resampled lift is
    # negative, without fixed items none is positive.
    if broke == 0:
        assert result.low >= 0.0
    if fixed == 0:
        assert result.high <= 0.0
    flips = flip_indices(baseline, treated)
    assert len(flips.fixed) == fixed and len(flips.broke) == broke
    assert all(treated[i] and not baseline[i] for i in flips.fixed)
    assert all(baseline[i] and not treated[i] for i in flips.broke)


def test_numpy_and_integer_inputs_are_accepted() -> None:
    as_ints = paired_bootstrap_lift([1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1], resamples=100)
    as_bools = paired_bootstrap_lift(np.array(BASELINE), np.array(TREATED), resamples=100)
    assert as_ints == as_bools


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        paired_bootstrap_lift([], [])
    with pytest.raises(ValueError, match="lengths 3 and 2 differ"):
        paired_bootstrap_lift([True, False, True], [True, False])
    with pytest.raises(ValueError, match="only booleans"):
        paired_bootstrap_lift([0, 1, 2], [0, 1, 1])
    with pytest.raises(ValueError, match="only booleans"):
        paired_bootstrap_lift(["yes", "no"], [True, False])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="resamples"):
        paired_bootstrap_lift([True], [False], resamples=0)
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap_lift([True], [False], confidence=1.5)
    with pytest.raises(ValueError, match="one-dimensional"):
        paired_bootstrap_lift([[True]], [[False]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="empty"):
        flip_indices([], [])


def test_correctness_flips_by_hand() -> None:
    acc_baseline = [True, True, False, False, True, False, True]
    acc_treated = [True, False, True, False, False, False, True]
    flips = correctness_flips(acc_baseline, acc_treated)
    assert (flips.gained, flips.lost, flips.n) == (1, 2, 7)
    assert flips.flipped == 3
    assert flips.flip_rate == pytest.approx(3 / 7)
    with pytest.raises(ValueError, match="differ"):
        correctness_flips([True], [True, False])
