"""The standard normal distribution from the stdlib (no scipy in the package)."""

from __future__ import annotations

import math
from statistics import NormalDist

_STANDARD = NormalDist()


def quantile(probability: float) -> float:
    """Phi^-1(probability) (Wichura's AS 241, as implemented by `statistics.NormalDist`)."""
    return _STANDARD.inv_cdf(probability)


def upper_tail(z: float) -> float:
    """1 - Phi(z), via erfc so that tiny tail probabilities keep their relative precision."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))
