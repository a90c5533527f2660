"""Paired non-inferiority of task accuracy: is the treated target no worse than the baseline by
more than a margin, on the same items?

Of n items, b were right at baseline only (lost) and c right when treated only (gained). The
difference of paired proportions and its Wald variance (A. Agresti, Categorical Data Analysis,
3rd ed., section 11.1.3, var = [p12 + p21 - (p12 - p21)^2] / n with p12 = b/n, p21 = c/n):

    diff = acc(treated) - acc(baseline) = (c - b) / n
    var  = (b + c - (b - c)^2 / n) / n^2,   se = sqrt(var)

The non-inferiority test is the lower one of the two one-sided tests of TOST (D. J. Schuirmann,
J. Pharmacokinet. Biopharm. 15, 1987), with the normal approximation:

    H0: diff <= -margin   vs   H1: diff > -margin
    z = (diff + margin) / se,   p = 1 - Phi(z),   non_inferior = p < alpha

[low, high] = diff -/+ Phi^-1((1 + confidence) / 2) * se, clipped to [-1, 1]. Its default
confidence 1 - 2 alpha makes it the interval matching the test: non_inferior exactly when
low > -margin. Pass confidence=0.95 to report the usual 95 % interval instead.

Degenerate case: se = 0 (no discordant pairs, or every item discordant in the same direction)
means the sample shows no variability; z is then +/-infinity, so p = 0 when diff > -margin and
p = 1 otherwise, and the interval has zero width. With few discordant pairs the normal
approximation is poor: read the McNemar exact test and the counts alongside.

Note: the paper's TOST table (TinyLlama n = 300, p = 4.3e-5; Qwen2.5-3B n = 600, p = 0.009) is
reproduced by the unpaired variance p1 q1 / n + p2 q2 / n, not by this paired one; the paired
variance is the right one for two targets measured on the same items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from replay_audit.stats import _normal
from replay_audit.stats._validate import Flags, finite_float, paired_flags, probability_level
from replay_audit.stats.proportion import Interval


@dataclass(frozen=True, slots=True)
class TostResult:
    """diff = acc(treated) - acc(baseline) with [low, high] at `confidence`; p_value of the
    one-sided test H0: diff <= -margin; non_inferior = p_value < alpha."""

    diff: float
    low: float
    high: float
    p_value: float
    non_inferior: bool
    margin: float
    alpha: float
    confidence: float
    standard_error: float
    gained: int
    lost: int
    n: int

    @property
    def interval(self) -> Interval:
        return Interval(self.low, self.high)


def tost_noninferiority(
    acc_baseline: Flags,
    acc_treated: Flags,
    margin: float = 0.05,
    alpha: float = 0.05,
    confidence: float | None = None,
) -> TostResult:
    """Paired non-inferiority test of accuracy, treated vs baseline, on the same items (method,
    formulas and the degenerate se = 0 case in the module docstring). `margin` in [0, 1): the
    largest accuracy loss still called non-inferior."""
    base, treat = paired_flags(acc_baseline, acc_treated, ("acc_baseline", "acc_treated"))
    margin = finite_float(margin, "margin")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must lie in [0, 1), got {margin!r}")
    alpha = probability_level(alpha, "alpha")
    if alpha >= 0.5:
        raise ValueError(f"alpha must be below 0.5, got {alpha!r}")
    level = probability_level(1.0 - 2.0 * alpha if confidence is None else confidence, "confidence")

    n = base.size
    gained = int((treat & ~base).sum())
    lost = int((base & ~treat).sum())
    diff = (gained - lost) / n
    # Clamped at 0: b + c >= |b - c| >= (b - c)^2 / n mathematically, rounding aside.
    variance = max(0.0, (gained + lost - (gained - lost) ** 2 / n) / n**2)
    se = math.sqrt(variance)
    if se > 0.0:
        p_value = _normal.upper_tail((diff + margin) / se)
    else:
        p_value = 0.0 if diff > -margin else 1.0
    half_width = _normal.quantile((1.0 + level) / 2.0) * se
    return TostResult(
        diff=diff,
        low=max(-1.0, diff - half_width),
        high=min(1.0, diff + half_width),
        p_value=p_value,
        non_inferior=p_value < alpha,
        margin=margin,
        alpha=alpha,
        confidence=level,
        standard_error=se,
        gained=gained,
        lost=lost,
        n=n,
    )
