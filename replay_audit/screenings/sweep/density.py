"""Trigger density, CV(TD) and the τ calibration: plain functions of stored margins. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def trigger_density(margins: npt.ArrayLike, thresholds: npt.ArrayLike) -> float | None:
    """Share of steps whose margin is below its threshold (None for no step). NaN margins
    (not finite) never count as below."""
    m = np.asarray(margins, dtype=np.float64)
    if m.size == 0:
        return None
    below = np.asarray(m < np.asarray(thresholds, dtype=np.float64))
    return float(below.sum() / m.size)


def coefficient_of_variation(
    values: Sequence[float],
) -> tuple[float | None, float | None, float | None]:
    """(mean, population standard deviation, CV = std / mean) of `values`; CV is None when the
    mean is 0 or there are fewer than two values (no spread to speak of)."""
    if not values:
        return None, None, None
    xs = np.asarray(values, dtype=np.float64)
    mean = float(xs.mean())
    std = float(xs.std(ddof=0))
    return mean, std, (std / mean if len(values) >= 2 and mean > 0 else None)


def covering_tau(flip_margins: Sequence[float], cover: float) -> float | None:
    """The smallest τ such that at least `cover` of `flip_margins` are < τ (the gate fires on
    Δ < τ): the next float above the k-th smallest margin, k = ceil(cover · n). None for no
    finite margin."""
    xs = sorted(x for x in flip_margins if math.isfinite(x))
    if not xs:
        return None
    k = max(1, math.ceil(cover * len(xs) - 1e-12))
    return math.nextafter(xs[k - 1], math.inf)


def format_tau(tau: float) -> str:
    """A covering τ as it reads: the float after 0 (every covered flip an exact tie, the gate
    firing on ties only) as '0⁺ (exact ties)', not 4.94e-324; else to 3 significant digits."""
    return "0⁺ (exact ties)" if tau > 0 and math.nextafter(tau, 0.0) == 0 else f"{tau:.3g}"
