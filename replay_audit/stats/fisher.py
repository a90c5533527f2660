"""Fisher's exact test of two proportions, one-sided (R. A. Fisher, 1935; e.g. A. Agresti,
Categorical Data Analysis, 3rd ed., section 3.5): is the first group's success rate lower
(or higher) than the second's?

Two independent groups: x1 successes of n1 and x2 of n2. Conditioned on the total number of
successes K = x1 + x2, under H0 (one common success probability, whatever it is) the first
group's count is hypergeometric: X ~ Hypergeometric(N = n1 + n2, K, n1),

    P(X = k) = C(K, k) C(N - K, n1 - k) / C(N, n1),

and the one-sided p-values are the tails at the observed x1:

    less:     p = P(X <= x1)        (the first rate is lower: a drop)
    greater:  p = P(X >= x1)        (the first rate is higher: a rise)

The test is exact and conservative: under H0, P(p <= alpha) <= alpha for every alpha and every
common success probability (the discreteness only makes it smaller), so rejecting at
p <= alpha has a false-alarm rate of at most alpha. No normal approximation, so it holds at
n = 8 as at n = 10,000, and with rates near 0 or 1 (where a two-proportion z-test does not).

Computation: one pmf term from log-binomial-coefficients (`math.lgamma`), then the tail is
summed outward by the exact ratio

    P(X = k - 1) / P(X = k) = k (N - K - n1 + k) / ((K - k + 1) (n1 - k + 1)),

always over the tail that does not contain the mode (the other is 1 minus it), so every term
is smaller than the last and the sum stops once the rest cannot change it in double precision.
Relative error ~1e-10 at N ~ 10^5 (the lgamma terms' rounding), far below any alpha.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from replay_audit.stats._validate import count

Alternative = Literal["less", "greater"]

# Relative size below which the rest of a decreasing tail is dropped.
_TAIL_EPSILON = 2.0**-60


@dataclass(frozen=True, slots=True)
class FisherResult:
    """x1/n1 (the group tested, e.g. the latest run) against x2/n2 (e.g. the pooled baseline
    runs); `alternative` the direction tested; `p_value` the one-sided exact p-value."""

    x1: int
    n1: int
    x2: int
    n2: int
    alternative: Alternative
    p_value: float


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1.0) - math.lgamma(k + 1.0) - math.lgamma(n - k + 1.0)


def hypergeom_cdf(k: int, total: int, successes: int, draws: int) -> float:
    """P(X <= k) for X ~ Hypergeometric(total, successes, draws): `draws` items taken without
    replacement from `total`, of which `successes` are successes."""
    total, successes, draws = (
        count(total, "total"),
        count(successes, "successes"),
        count(draws, "draws"),
    )
    if successes > total or draws > total:
        raise ValueError(
            f"successes ({successes}) and draws ({draws}) must not exceed total ({total})"
        )
    lo, hi = max(0, draws - (total - successes)), min(draws, successes)
    if k < lo:
        return 0.0
    if k >= hi:
        return 1.0
    mode = (draws + 1) * (successes + 1) // (total + 2)
    if k < mode:
        return _tail(k, -1, lo, hi, total, successes, draws)
    return max(0.0, 1.0 - _tail(k + 1, +1, lo, hi, total, successes, draws))


def _tail(start: int, step: int, lo: int, hi: int, total: int, successes: int, draws: int) -> float:
    """Sum of P(X = k) from `start` outward (step -1: down to lo; +1: up to hi), `start` on the
    side of the mode where the terms decrease outward."""
    log_term = (
        _log_comb(successes, start)
        + _log_comb(total - successes, draws - start)
        - _log_comb(total, draws)
    )
    term = math.exp(log_term)
    acc = term
    k = start
    fail_total = total - successes
    while (k > lo) if step < 0 else (k < hi):
        if step < 0:
            # P(k - 1) / P(k)
            term *= k * (fail_total - draws + k) / ((successes - k + 1) * (draws - k + 1))
            k -= 1
        else:
            # P(k + 1) / P(k)
            term *= (successes - k) * (draws - k) / ((k + 1) * (fail_total - draws + k + 1))
            k += 1
        acc += term
        if term < acc * _TAIL_EPSILON:
            break
    return min(1.0, acc)


def fisher_exact(
    x1: int, n1: int, x2: int, n2: int, *, alternative: Alternative = "less"
) -> FisherResult:
    """One-sided Fisher exact test of x1/n1 against x2/n2 (`alternative`: module docstring).
    A group with n = 0 gives p = 1."""
    x1, n1, x2, n2 = count(x1, "x1"), count(n1, "n1"), count(x2, "x2"), count(n2, "n2")
    if x1 > n1:
        raise ValueError(f"x1 ({x1}) must not exceed n1 ({n1})")
    if x2 > n2:
        raise ValueError(f"x2 ({x2}) must not exceed n2 ({n2})")
    if alternative not in ("less", "greater"):
        raise ValueError(f"alternative must be 'less' or 'greater', got {alternative!r}")
    total, successes = n1 + n2, x1 + x2
    if alternative == "less":
        p = hypergeom_cdf(x1, total, successes, n1)
    else:
        # X >= x1 is "at most n1 - x1 failures drawn": a lower tail again, with no
        # subtraction to lose digits near zero.
        p = hypergeom_cdf(n1 - x1, total, total - successes, n1)
    return FisherResult(x1=x1, n1=n1, x2=x2, n2=n2, alternative=alternative, p_value=p)
