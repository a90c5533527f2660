"""Wilson intervals against published worked examples and an independent numerical inversion of
the score test (scipy.optimize + scipy.stats.norm, tests only)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize
from scipy import stats as sps

from replay_audit.stats import Interval, proportion, rate, wilson_interval


@pytest.mark.parametrize(
    ("x", "n", "low", "high"),
    [
        # Newcombe (1998), Stat. Med. 17:857-872, Table I, method 3 (score, no continuity corr.).
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0000, 0.1611),
        (1, 29, 0.0061, 0.1718),
    ],
)
def test_newcombe_1998_worked_examples(x: int, n: int, low: float, high: float) -> None:
    interval = wilson_interval(x, n)
    assert round(interval.low, 4) == low
    assert round(interval.high, 4) == high


@pytest.mark.parametrize(
    ("x", "low_pct", "high_pct"),
    [
        # The paper's Table 1 (n = 100): MBPP, HumanEval, GSM8K; and its 0/100 cells [0.0, 3.7].
        (30, 21.9, 39.6),
        (36, 27.3, 45.8),
        (41, 31.9, 50.8),
        (0, 0.0, 3.7),
    ],
)
def test_paper_table_values(x: int, low_pct: float, high_pct: float) -> None:
    interval = wilson_interval(x, 100)
    assert round(100 * interval.low, 1) == low_pct
    assert round(100 * interval.high, 1) == high_pct


def _score_test_bounds(x: int, n: int, confidence: float) -> tuple[float, float]:
    """The Wilson interval by definition: the p in (0, 1) where the score statistic
    |x/n - p| / sqrt(p (1 - p) / n) equals z, found by root finding."""
    z = float(sps.norm.ppf(1 - (1 - confidence) / 2))
    p_hat = x / n

    def excess(p: float) -> float:
        return abs(p_hat - p) - z * math.sqrt(p * (1 - p) / n)

    tiny = 1e-300
    stop = min(p_hat, 1 - 1e-16)
    low = 0.0 if x == 0 else optimize.brentq(excess, tiny, stop, xtol=1e-15, rtol=1e-14)
    start = max(p_hat, tiny)
    high = 1.0 if x == n else optimize.brentq(excess, start, 1 - 1e-16, xtol=1e-15, rtol=1e-14)
    return low, high


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=100_000),
    fraction=st.floats(min_value=0.0, max_value=1.0),
    confidence=st.sampled_from([0.5, 0.8, 0.9, 0.95, 0.99, 0.999]),
)
def test_matches_inverted_score_test(n: int, fraction: float, confidence: float) -> None:
    x = round(fraction * n)
    interval = wilson_interval(x, n, confidence)
    low, high = _score_test_bounds(x, n, confidence)
    assert interval.low == pytest.approx(low, abs=1e-12)
    assert interval.high == pytest.approx(high, abs=1e-12)
    assert 0.0 <= interval.low <= x / n <= interval.high <= 1.0


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=1, max_value=10_000), fraction=st.floats(0.0, 1.0))
def test_symmetric_under_swapping_successes_and_failures(n: int, fraction: float) -> None:
    x = round(fraction * n)
    a, b = wilson_interval(x, n), wilson_interval(n - x, n)
    assert a.low == pytest.approx(1 - b.high, abs=1e-14)
    assert a.high == pytest.approx(1 - b.low, abs=1e-14)


def test_zero_and_all_successes_pin_the_end_exactly() -> None:
    z2 = float(sps.norm.ppf(0.975)) ** 2
    none = wilson_interval(0, 50)
    assert none.low == 0.0
    assert none.high == pytest.approx(z2 / (50 + z2), rel=1e-12)
    every = wilson_interval(50, 50)
    assert every.high == 1.0
    assert every.low == pytest.approx(50 / (50 + z2), rel=1e-12)


def test_wider_with_higher_confidence_and_narrower_with_more_data() -> None:
    assert wilson_interval(30, 100, 0.99).width > wilson_interval(30, 100, 0.95).width
    assert wilson_interval(300, 1000).width < wilson_interval(30, 100).width


def test_no_trials_gives_the_whole_unit_interval_and_no_estimate() -> None:
    assert wilson_interval(0, 0) == Interval(0.0, 1.0)
    result = proportion(0, 0)
    assert result.estimate is None
    assert result.interval == Interval(0.0, 1.0)


def test_proportion_carries_estimate_and_interval() -> None:
    result = proportion(41, 100)
    assert result.estimate == 0.41
    assert (result.successes, result.n, result.confidence) == (41, 100, 0.95)
    assert result.interval == wilson_interval(41, 100)
    assert 0.41 in result.interval


def test_numpy_integer_counts_are_accepted() -> None:
    assert wilson_interval(np.int64(41), np.int64(100)) == wilson_interval(41, 100)  # type: ignore[arg-type]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot exceed"):
        wilson_interval(5, 4)
    with pytest.raises(ValueError, match="successes must be >= 0"):
        wilson_interval(-1, 4)
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 4, confidence=1.0)
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 4, confidence=0.0)
    with pytest.raises(TypeError, match="not a bool"):
        wilson_interval(True, 4)
    with pytest.raises(TypeError, match="integer"):
        wilson_interval(1.5, 4)  # type: ignore[arg-type]


def test_rate() -> None:
    assert rate(3, 12) == 0.25
    assert rate(0, 12) == 0.0
    assert rate(0, 0) is None
    with pytest.raises(ValueError, match="cannot exceed"):
        rate(13, 12)
