"""Descriptive summaries for reports: distributions of t*, of the margin at t* (absolute and in
ulps) and of length differences; histograms on linear and log axes; category breakdowns.

Quantiles use numpy's default linear interpolation between order statistics (Hyndman & Fan
1996, definition 7, the same as R's default and `statistics.quantiles(method="inclusive")`).

Log histograms exist for margins: they span many decades (1e-6 to 10) and BF16 margins are
often exactly 0 (two logits that round to the same BF16 value), which a log axis cannot show,
so zeros are counted apart from the bins.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from replay_audit.stats._validate import Values, count, finite_values, probability_level
from replay_audit.stats.proportion import Proportion, proportion


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary of a sample: n, min, median, 90th percentile, max and mean."""

    n: int
    min: float
    median: float
    p90: float
    max: float
    mean: float


@dataclass(frozen=True, slots=True)
class Histogram:
    """counts[i] values fall in [edges[i], edges[i+1]) (the last bin also includes its right
    edge, as in `numpy.histogram`)."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True, slots=True)
class LogHistogram:
    """A histogram of non-negative values on a log axis. Bins as in `Histogram`, with edges at
    powers of ten (`bins_per_decade` bins per decade); `zeros` counts exact zeros, `below` and
    `above` the positive values outside [edges[0], edges[-1]] (only possible when the decades
    were given)."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]
    zeros: int
    below: int
    above: int

    @property
    def total(self) -> int:
        return sum(self.counts) + self.zeros + self.below + self.above


def quantiles(values: Values, probabilities: Sequence[float]) -> tuple[float, ...]:
    """The sample quantiles of `values` at each probability in [0, 1] (linear interpolation,
    Hyndman & Fan definition 7). ValueError on empty or non-finite values."""
    data = finite_values(values, "values")
    probs = [float(p) for p in probabilities]
    if any(not 0.0 <= p <= 1.0 for p in probs):
        raise ValueError(f"probabilities must lie in [0, 1], got {probs}")
    return tuple(float(q) for q in np.quantile(data, probs))


def distribution(values: Values) -> Distribution:
    """n, min, median, p90, max and mean of `values` (e.g. t* of the divergent traces, margins
    at t*, length differences). ValueError on empty or non-finite values: a distribution of
    nothing has no median; callers show "none" instead."""
    data = finite_values(values, "values")
    median, p90 = np.quantile(data, [0.5, 0.9])
    return Distribution(
        n=int(data.size),
        min=float(data.min()),
        median=float(median),
        p90=float(p90),
        max=float(data.max()),
        mean=float(data.mean()),
    )


def finite_distribution(values: Sequence[float | int | None]) -> Distribution | None:
    """`distribution` of the finite values (None, NaN and infinities left out); None when
    there are none."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return distribution(xs) if xs else None


def histogram(
    values: Values,
    bins: int | Sequence[float] = 10,
    value_range: tuple[float, float] | None = None,
) -> Histogram:
    """Counts of `values` in `bins` equal-width bins over `value_range` (default: min to max),
    or in the bins between the given increasing edges; values outside explicit edges or range
    are not counted. Empty values are allowed (all counts 0)."""
    data = finite_values(values, "values", allow_empty=True)
    if np.ndim(bins) == 0:
        n_bins = count(cast(int, bins), "bins")
        if n_bins < 1:
            raise ValueError(f"bins must be >= 1, got {n_bins}")
        counts, edges = np.histogram(data, bins=n_bins, range=value_range)
    else:
        edges_in = np.asarray(bins, dtype=np.float64)
        if edges_in.ndim != 1 or edges_in.size < 2 or not (np.diff(edges_in) > 0).all():
            raise ValueError("bin edges must be at least two strictly increasing numbers")
        counts, edges = np.histogram(data, bins=edges_in)
    return Histogram(edges=tuple(float(e) for e in edges), counts=tuple(int(c) for c in counts))


def log_histogram(
    values: Values,
    decades: tuple[int, int] | None = None,
    bins_per_decade: int = 1,
) -> LogHistogram:
    """Histogram of non-negative `values` (margins) on a log10 axis, zeros counted apart.
    decades=(lo, hi) fixes the axis to [10^lo, 10^hi] (to compare runs); by default it is the
    smallest span of whole decades holding every positive value (none: no bins)."""
    data = finite_values(values, "values", allow_empty=True)
    if (data < 0).any():
        raise ValueError("log_histogram needs non-negative values (margins are >= 0)")
    per_decade = count(bins_per_decade, "bins_per_decade")
    if per_decade < 1:
        raise ValueError("bins_per_decade must be >= 1")
    positive = data[data > 0]
    zeros = int(data.size - positive.size)

    if decades is None:
        if positive.size == 0:
            return LogHistogram(edges=(), counts=(), zeros=zeros, below=0, above=0)
        smallest, largest = float(positive.min()), float(positive.max())
        lo, hi = math.floor(math.log10(smallest)), math.ceil(math.log10(largest))
        # log10 rounds: make sure the whole-decade edges really enclose the data.
        while 10.0**lo > smallest:
            lo -= 1
        while 10.0**hi < largest:
            hi += 1
        hi = max(hi, lo + 1)
    else:
        lo, hi = int(decades[0]), int(decades[1])
        if hi <= lo:
            raise ValueError(f"decades must be (lo, hi) with lo < hi, got {decades}")

    steps = (hi - lo) * per_decade
    edges = np.array([10.0 ** (lo + i / per_decade) for i in range(steps + 1)])
    counts, _ = np.histogram(positive, bins=edges)
    return LogHistogram(
        edges=tuple(float(e) for e in edges),
        counts=tuple(int(c) for c in counts),
        zeros=zeros,
        below=int((positive < edges[0]).sum()),
        above=int((positive > edges[-1]).sum()),
    )


def breakdown(
    labels: Iterable[str],
    categories: Sequence[str] | None = None,
    confidence: float = 0.95,
) -> dict[str, Proportion]:
    """Share of each category among `labels` (e.g. agreed / head_reachable / kv_dependent /
    body_dominated), each with its Wilson interval. With `categories`, every one appears in
    that order (absent ones with 0) and an unknown label is a ValueError; without, categories
    appear in order of first occurrence."""
    level = probability_level(confidence, "confidence")
    tally: dict[str, int] = dict.fromkeys(categories, 0) if categories is not None else {}
    for label in labels:
        if label not in tally:
            if categories is not None:
                raise ValueError(f"unknown category {label!r}; expected one of {list(categories)}")
            tally[label] = 0
        tally[label] += 1
    total = sum(tally.values())
    return {name: proportion(k, total, level) for name, k in tally.items()}
