"""binom_cdf / binom_pmf against scipy.stats.binom (the independent reference, tests only)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from replay_audit.stats import binom_cdf, binom_pmf


def _close(ours: float, reference: float, rtol: float) -> bool:
    # Below ~1e-280 scipy itself loses relative precision; compare absolutely there.
    return math.isclose(ours, reference, rel_tol=rtol, abs_tol=1e-280)


@pytest.mark.parametrize("n", [1, 2, 7, 50, 1_000, 100_000, 1_000_000])
@pytest.mark.parametrize("p", [0.5, 0.01, 0.3, 0.999])
def test_cdf_matches_scipy_across_the_support(n: int, p: float) -> None:
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    ks = {0, 1, n - 1, int(mean), int(mean) + 1}
    ks |= {int(mean + z * sd) for z in (-8, -3, -1, 1, 3, 8)}
    for k in sorted(x for x in ks if 0 <= x <= n):
        assert _close(binom_cdf(k, n, p), float(sps.binom.cdf(k, n, p)), 1e-11), (k, n, p)
        assert _close(binom_pmf(k, n, p), float(sps.binom.pmf(k, n, p)), 1e-11), (k, n, p)


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=5_000),
    k_fraction=st.floats(min_value=-0.01, max_value=1.01),
    p=st.floats(min_value=0.0, max_value=1.0),
)
def test_cdf_property_against_scipy(n: int, k_fraction: float, p: float) -> None:
    k = math.floor(k_fraction * n)
    assert _close(binom_cdf(k, n, p), float(sps.binom.cdf(k, n, p)), 1e-10)


def test_pmf_sums_to_one_and_cdf_is_its_running_sum() -> None:
    n, p = 40, 0.37
    pmf = [binom_pmf(k, n, p) for k in range(n + 1)]
    assert math.isclose(math.fsum(pmf), 1.0, rel_tol=1e-13)
    for k in range(n + 1):
        assert math.isclose(binom_cdf(k, n, p), math.fsum(pmf[: k + 1]), rel_tol=1e-12)


def test_small_cases_by_hand() -> None:
    # Binomial(3, 1/2): pmf 1/8, 3/8, 3/8, 1/8.
    assert binom_cdf(0, 3) == pytest.approx(1 / 8, rel=1e-15)
    assert binom_cdf(1, 3) == pytest.approx(4 / 8, rel=1e-15)
    assert binom_cdf(2, 3) == pytest.approx(7 / 8, rel=1e-15)
    assert binom_pmf(1, 3) == pytest.approx(3 / 8, rel=1e-15)


def test_edges_of_the_support_and_degenerate_p() -> None:
    assert binom_cdf(-1, 10, 0.5) == 0.0
    assert binom_cdf(10, 10, 0.5) == 1.0
    assert binom_cdf(11, 10, 0.5) == 1.0
    assert binom_cdf(0, 0, 0.3) == 1.0
    assert binom_cdf(0, 10, 0.0) == 1.0
    assert binom_cdf(9, 10, 1.0) == 0.0
    assert binom_pmf(10, 10, 1.0) == 1.0
    assert binom_pmf(0, 10, 0.0) == 1.0
    assert binom_pmf(11, 10, 0.5) == 0.0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="p must lie"):
        binom_cdf(1, 10, 1.5)
    with pytest.raises(ValueError, match="n must be >= 0"):
        binom_cdf(1, -1)
    with pytest.raises(TypeError, match="integer"):
        binom_cdf(1, 10.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        binom_cdf(2.5, 10)  # type: ignore[arg-type]


@pytest.mark.parametrize(("k", "n"), [(10, 1075), (0, 1000), (3, 60), (500, 1001), (4_900, 10_000)])
def test_fair_coin_cdf_matches_exact_rational_arithmetic(k: int, n: int) -> None:
    # Exact: sum of binomial coefficients over 2^n, with Python's unbounded integers. Covers a
    # tail (2.7e-300) where scipy underflows to 0.
    exact = Fraction(sum(math.comb(n, j) for j in range(k + 1)), 2**n)
    assert binom_cdf(k, n) == pytest.approx(float(exact), rel=1e-12)
