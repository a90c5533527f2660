"""Distributions, quantiles and histograms against the stdlib `statistics` module and counting
by hand."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_audit.stats import (
    Histogram,
    breakdown,
    distribution,
    histogram,
    log_histogram,
    quantiles,
    wilson_interval,
)

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(finite, min_size=2, max_size=300))
def test_distribution_matches_statistics_module(values: list[float]) -> None:
    result = distribution(values)
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    assert result.n == len(values)
    assert result.min == min(values) and result.max == max(values)
    assert result.median == pytest.approx(statistics.median(values), abs=1e-6)
    assert result.p90 == pytest.approx(deciles[8], abs=1e-6)
    assert result.mean == pytest.approx(statistics.fmean(values), abs=1e-6)
    assert result.min <= result.median <= result.p90 <= result.max


def test_distribution_of_first_divergence_steps() -> None:
    result = distribution([1, 3, 3, 34, 50, 120, 250])
    assert (result.n, result.min, result.median, result.max) == (7, 1.0, 34.0, 250.0)
    assert result.mean == pytest.approx(461 / 7)
    assert result.p90 == pytest.approx(120 + 0.4 * 130)  # rank 0.9 * 6 = 5.4


def test_single_value() -> None:
    result = distribution([0.125])
    assert (result.min, result.median, result.p90, result.max, result.mean) == (0.125,) * 5


def test_quantiles_match_statistics_inclusive() -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    assert quantiles(values, [0.25, 0.5, 0.75]) == pytest.approx(tuple(quartiles))
    assert quantiles(values, [0.0, 1.0]) == (1.0, 9.0)


def test_empty_or_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        distribution([])
    with pytest.raises(ValueError, match="empty"):
        quantiles([], [0.5])
    with pytest.raises(ValueError, match="NaN"):
        distribution([1.0, float("nan")])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        quantiles([1.0], [1.5])


def test_histogram_counts_by_hand() -> None:
    result = histogram([0, 1, 1, 2, 3, 4, 4, 4], bins=4)
    assert result.edges == (0.0, 1.0, 2.0, 3.0, 4.0)
    assert result.counts == (1, 2, 1, 4)  # the last bin includes its right edge
    assert result.total == 8


def test_histogram_with_edges_drops_values_outside() -> None:
    result = histogram([-5, 0, 5, 10, 15, 99], bins=[0, 10, 20])
    assert result.counts == (2, 2)
    assert histogram([], bins=[0, 1]) == Histogram(edges=(0.0, 1.0), counts=(0,))


def test_histogram_range_and_numpy_bin_count() -> None:
    result = histogram([1.0, 2.0, 7.0], bins=np.int64(2), value_range=(0.0, 10.0))  # type: ignore[arg-type]
    assert result.edges == (0.0, 5.0, 10.0)
    assert result.counts == (2, 1)


def test_histogram_bad_bins() -> None:
    with pytest.raises(ValueError, match="bins"):
        histogram([1.0], bins=0)
    with pytest.raises(ValueError, match="increasing"):
        histogram([1.0], bins=[1.0, 1.0])


def test_log_histogram_counts_zeros_apart() -> None:
    margins = [0.0, 0.0, 0.0, 1e-4, 5e-4, 2e-3, 0.5, 3.0]
    result = log_histogram(margins)
    assert result.zeros == 3
    assert result.edges == pytest.approx((1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0))
    assert result.counts == (2, 1, 0, 1, 1)
    assert (result.below, result.above) == (0, 0)
    assert result.total == len(margins)


def test_log_histogram_exact_powers_of_ten() -> None:
    result = log_histogram([1e-3, 1.0])
    assert len(result.counts) == 3
    assert result.counts[0] == 1 and result.counts[-1] == 1
    assert log_histogram([1.0]).counts == (1,)


def test_log_histogram_fixed_decades_and_finer_bins() -> None:
    result = log_histogram([1e-8, 0.005, 0.02, 500.0], decades=(-3, 1), bins_per_decade=2)
    assert len(result.edges) == 9
    assert result.edges[0] == pytest.approx(1e-3) and result.edges[-1] == pytest.approx(10.0)
    assert result.edges[1] == pytest.approx(10**-2.5)
    assert (result.below, result.above, result.zeros) == (1, 1, 0)
    assert result.counts[1] == 1  # 0.005 in [10^-2.5, 10^-2)
    assert result.counts[2] == 1  # 0.02 in [10^-2, 10^-1.5)
    assert sum(result.counts) == 2


def test_log_histogram_only_zeros_has_no_bins() -> None:
    result = log_histogram([0.0, 0.0])
    assert (result.edges, result.counts, result.zeros) == ((), (), 2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(st.just(0.0), st.floats(min_value=1e-300, max_value=1e300)),
        max_size=200,
    )
)
def test_log_histogram_accounts_for_every_value(values: list[float]) -> None:
    result = log_histogram(values)
    assert result.total == len(values)
    assert result.zeros == values.count(0.0)
    assert (result.below, result.above) == (0, 0)
    for value in values:
        if value > 0:
            assert result.edges[0] <= value <= result.edges[-1]


def test_log_histogram_refuses_negative_values_and_bad_decades() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        log_histogram([-1e-3])
    with pytest.raises(ValueError, match="lo < hi"):
        log_histogram([1.0], decades=(2, 2))
    with pytest.raises(ValueError, match="bins_per_decade"):
        log_histogram([1.0], bins_per_decade=0)


def test_breakdown_with_known_categories() -> None:
    labels = ["agreed", "head_reachable", "agreed", "body_dominated", "agreed"]
    order = ["agreed", "head_reachable", "kv_dependent", "body_dominated"]
    result = breakdown(labels, order)
    assert list(result) == order
    assert [result[c].successes for c in order] == [3, 1, 0, 1]
    assert result["agreed"].estimate == pytest.approx(0.6)
    assert result["kv_dependent"].interval == wilson_interval(0, 5)
    with pytest.raises(ValueError, match="unknown category"):
        breakdown(["other"], order)


def test_breakdown_in_order_of_appearance() -> None:
    result = breakdown(["b", "a", "b"])
    assert list(result) == ["b", "a"]
    assert result["b"].successes == 2 and result["b"].n == 3
