"""McNemar's exact test on paired binary outcomes (Q. McNemar, Psychometrika 12, 1947; the exact
conditional form, e.g. A. Agresti, Categorical Data Analysis, 3rd ed., section 11.1.4).

Of n items measured under two arms, only the discordant pairs carry information: b items
succeed under the first arm only, c under the second only. Under H0 (both arms have the same
success probability) each discordant pair is equally likely to fall either way, so
b ~ Binomial(b + c, 1/2) given b + c, and the two-sided exact p-value is

    p = min(1, 2 * BinomCDF(min(b, c); b + c, 1/2))

(the doubled smaller tail, which for p = 1/2 equals the sum of all outcomes no more likely than
the observed one, as `scipy.stats.binomtest` computes). b + c = 0 gives p = 1. Paper examples:
b, c = 4, 2 -> 0.688; 1, 6 -> 0.125; 0, 3 -> 0.250; 3, 1 -> 0.625.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay_audit.stats._validate import count
from replay_audit.stats.binomial import binom_cdf


@dataclass(frozen=True, slots=True)
class McNemarResult:
    """b: pairs where only the first arm succeeds (e.g. traces the intervention broke);
    c: only the second (traces it fixed); statistic: min(b, c), the exact test's statistic."""

    b: int
    c: int
    statistic: int
    p_value: float

    @property
    def discordant(self) -> int:
        return self.b + self.c


def mcnemar_exact(b: int, c: int) -> McNemarResult:
    """Exact two-sided McNemar test on the discordant counts b and c (module docstring)."""
    b, c = count(b, "b"), count(c, "c")
    smaller = min(b, c)
    p_value = min(1.0, 2.0 * binom_cdf(smaller, b + c, 0.5)) if b + c else 1.0
    return McNemarResult(b=b, c=c, statistic=smaller, p_value=p_value)
