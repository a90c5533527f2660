"""The one-sided Fisher exact test behind the drift alerts: against exact rational arithmetic
(math.comb), hand-worked values, scipy.stats.fisher_exact, and its false-alarm rate under H0
and power on clear drops by simulation (fixed seed)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from replay_audit.stats import fisher_exact, hypergeom_cdf


def _exact_less(x1: int, n1: int, x2: int, n2: int) -> Fraction:
    """P(X <= x1), X ~ Hypergeometric(n1 + n2, x1 + x2, n1), in exact rationals."""
    total, successes = n1 + n2, x1 + x2
    num = sum(
        math.comb(successes, k) * math.comb(total - successes, n1 - k) for k in range(0, x1 + 1)
    )
    return Fraction(num, math.comb(total, n1))


def test_the_issues_noise_case_by_hand() -> None:
    """5/8 against 19/24 (the issue's 62.5% at n = 8 against a 3-run mean of 79.2%):
    N = 32, K = 24, n = 8; P(X <= 5) = [C(24,5)C(8,3) + C(24,4)C(8,4) + C(24,3)C(8,5)
    + C(24,2)C(8,6) + C(24,1)C(8,7) + C(24,0)C(8,8)] / C(32,8)
    = (2380224 + 743820 + 113344 + 7728 + 192 + 1) / 10518300 = 3245309 / 10518300."""
    assert math.comb(32, 8) == 10518300
    r = fisher_exact(5, 8, 19, 24, alternative="less")
    assert r.p_value == pytest.approx(3245309 / 10518300, rel=1e-12)
    assert r.p_value > 0.3  # nowhere near any alpha: noise
    assert (r.x1, r.n1, r.x2, r.n2, r.alternative) == (5, 8, 19, 24, "less")


def test_a_new_category_by_hand() -> None:
    """4 of 12 in a category never seen in 24 before: P(X >= 4) with K = 4 is the single term
    C(12,4) / C(36,4) = 495 / 58905."""
    r = fisher_exact(4, 12, 0, 24, alternative="greater")
    assert r.p_value == pytest.approx(495 / 58905, rel=1e-12)
    # One divergence of 100 after 0 of 700: C(100,1)/C(800,1) = 1/8, not news.
    assert fisher_exact(1, 100, 0, 700, alternative="greater").p_value == pytest.approx(0.125)


def test_a_clear_drop_is_tiny() -> None:
    r = fisher_exact(20, 200, 150, 200)
    assert 0 < r.p_value < 1e-30
    assert r.p_value == pytest.approx(float(_exact_less(20, 200, 150, 200)), rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(
    n1=st.integers(0, 60),
    n2=st.integers(0, 60),
    data=st.data(),
)
def test_matches_exact_rationals(n1: int, n2: int, data: st.DataObject) -> None:
    x1 = data.draw(st.integers(0, n1))
    x2 = data.draw(st.integers(0, n2))
    exact = _exact_less(x1, n1, x2, n2)
    assert fisher_exact(x1, n1, x2, n2).p_value == pytest.approx(float(exact), rel=1e-11)
    # "greater" is "less" with successes and failures swapped.
    flipped = _exact_less(n1 - x1, n1, n2 - x2, n2)
    assert fisher_exact(x1, n1, x2, n2, alternative="greater").p_value == pytest.approx(
        float(flipped), rel=1e-11
    )


@settings(max_examples=100, deadline=None)
@given(
    n1=st.integers(1, 5_000),
    n2=st.integers(1, 20_000),
    data=st.data(),
)
def test_matches_scipy(n1: int, n2: int, data: st.DataObject) -> None:
    x1 = data.draw(st.integers(0, n1))
    x2 = data.draw(st.integers(0, n2))
    table = [[x1, n1 - x1], [x2, n2 - x2]]
    for alternative in ("less", "greater"):
        ours = fisher_exact(x1, n1, x2, n2, alternative=alternative).p_value
        ref = float(sps.fisher_exact(table, alternative=alternative).pvalue)
        assert ours == pytest.approx(ref, rel=1e-8, abs=1e-280), alternative


def test_hypergeom_cdf_edges_and_scipy() -> None:
    assert hypergeom_cdf(-1, 10, 5, 3) == 0.0
    assert hypergeom_cdf(3, 10, 5, 3) == 1.0
    assert hypergeom_cdf(0, 10, 0, 3) == 1.0  # no successes at all
    for k in range(0, 51):
        assert hypergeom_cdf(k, 200, 90, 50) == pytest.approx(
            float(sps.hypergeom.cdf(k, 200, 90, 50)), rel=1e-10
        )


def test_empty_groups_give_one() -> None:
    assert fisher_exact(0, 0, 5, 10).p_value == 1.0
    assert fisher_exact(3, 10, 0, 0).p_value == 1.0
    assert fisher_exact(0, 0, 0, 0, alternative="greater").p_value == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [((5, 4, 1, 2), "x1"), ((1, 2, 5, 4), "x2"), ((-1, 2, 1, 2), "x1")],
)
def test_bad_counts(args: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fisher_exact(*args)


def test_bad_alternative() -> None:
    with pytest.raises(ValueError, match="alternative"):
        fisher_exact(1, 2, 1, 2, alternative="two-sided")  # type: ignore[arg-type]


@pytest.mark.parametrize("p", [0.5, 0.8, 0.95])
def test_false_alarm_rate_under_the_null(p: float) -> None:
    """2,000 simulated (baseline of 3 runs of 40, latest run of 40) with one rate p: the test
    at alpha = 0.01 rejects on at most alpha of them (it is conservative), with a tolerance of
    3 binomial standard errors for the simulation itself."""
    alpha, sims = 0.01, 2_000
    rng = np.random.default_rng(20261122)
    base = rng.binomial(120, p, sims)
    latest = rng.binomial(40, p, sims)
    rate = np.mean(
        [
            fisher_exact(int(x), 40, int(b), 120).p_value <= alpha
            for x, b in zip(latest, base, strict=True)
        ]
    )
    assert rate <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / sims)


def test_power_on_clear_drops() -> None:
    """A drop from 75% to 10% at n = 200 a side, and from 95% to 80% at n = 200 against a
    pooled 600: caught essentially always at alpha = 0.01."""
    alpha, sims = 0.01, 500
    rng = np.random.default_rng(7)
    for p0, p1, n1, n2, min_power in ((0.75, 0.10, 200, 200, 0.999), (0.95, 0.80, 200, 600, 0.99)):
        base = rng.binomial(n2, p0, sims)
        latest = rng.binomial(n1, p1, sims)
        power = np.mean(
            [
                fisher_exact(int(x), n1, int(b), n2).p_value <= alpha
                for x, b in zip(latest, base, strict=True)
            ]
        )
        assert power >= min_power, (p0, p1, power)
