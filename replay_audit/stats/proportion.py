"""Proportions with Wilson score intervals: EAR, SAR, task accuracy, trigger rate.

Wilson score interval (E. B. Wilson, "Probable inference, the law of succession, and
statistical inference", JASA 22, 1927; method 3 of R. G. Newcombe, "Two-sided confidence
intervals for the single proportion: comparison of seven methods", Stat. Med. 17, 1998). With x
successes in n trials and z = Phi^-1(1 - (1 - confidence)/2), the interval is the set of p whose
score test |x/n - p| <= z sqrt(p (1 - p) / n) does not reject; solving the quadratic gives

    low, high = (2x + z^2 -/+ z sqrt(z^2 + 4 x (n - x) / n)) / (2 (n + z^2))

It stays inside [0, 1], is never zero-width, and at 0/n is (0, z^2 / (n + z^2)). Examples:
81/263 -> (0.2553, 0.3662) (Newcombe 1998); 41/100 -> (0.319, 0.508) (the paper's Table 1).

n = 0 (no traces yet) gives the whole interval (0, 1): it is the limit of the formula as
n -> 0, and says honestly that nothing is known. The point estimate is then None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from replay_audit.stats import _normal
from replay_audit.stats._validate import count, probability_level


@dataclass(frozen=True, slots=True)
class Interval:
    """A closed interval [low, high]."""

    low: float
    high: float

    @property
    def width(self) -> float:
        return self.high - self.low

    def __contains__(self, value: float) -> bool:
        return self.low <= value <= self.high


@dataclass(frozen=True, slots=True)
class Proportion:
    """successes / n with its Wilson interval; `estimate` is None when n == 0."""

    successes: int
    n: int
    estimate: float | None
    interval: Interval
    confidence: float


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> Interval:
    """Wilson score interval for successes/n (formula, sources and n = 0: module docstring)."""
    x, n = count(successes, "successes"), count(n, "n")
    if x > n:
        raise ValueError(f"successes ({x}) cannot exceed n ({n})")
    confidence = probability_level(confidence, "confidence")
    if n == 0:
        return Interval(0.0, 1.0)
    z = _normal.quantile(1.0 - (1.0 - confidence) / 2.0)
    z2 = z * z
    spread = z * math.sqrt(z2 + 4.0 * x * (n - x) / n)
    denominator = 2.0 * (n + z2)
    # The closed form gives exactly 0 at x = 0 and 1 at x = n only up to rounding; pin them.
    low = 0.0 if x == 0 else max(0.0, (2.0 * x + z2 - spread) / denominator)
    high = 1.0 if x == n else min(1.0, (2.0 * x + z2 + spread) / denominator)
    return Interval(low, high)


def proportion(successes: int, n: int, confidence: float = 0.95) -> Proportion:
    """successes/n with its Wilson interval: the result EAR, SAR and accuracy are reported as."""
    interval = wilson_interval(successes, n, confidence)
    x, n = count(successes, "successes"), count(n, "n")
    return Proportion(
        successes=x,
        n=n,
        estimate=x / n if n else None,
        interval=interval,
        confidence=float(confidence),
    )


def rate(numerator: int, denominator: int) -> float | None:
    """numerator / denominator for counts (e.g. gate firings / decoded steps); None when the
    denominator is 0, since a rate of nothing is undefined, not 0."""
    num, den = count(numerator, "numerator"), count(denominator, "denominator")
    if num > den:
        raise ValueError(f"numerator ({num}) cannot exceed denominator ({den})")
    return num / den if den else None
