"""Exact McNemar against scipy.stats.binomtest and the paper's reported matched-pair tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from replay_audit.stats import mcnemar_exact


@pytest.mark.parametrize(
    ("b", "c", "p_value"),
    [
        # The paper's quality-preservation section reports these counts (+gained / -lost) and p.
        (4, 2, 0.688),
        (8, 9, 1.000),
        (2, 1, 1.000),
        (1, 6, 0.125),
        (0, 3, 0.250),
        (3, 1, 0.625),
    ],
)
def test_paper_reported_values(b: int, c: int, p_value: float) -> None:
    assert round(mcnemar_exact(b, c).p_value, 3) == p_value


@settings(max_examples=300, deadline=None)
@given(b=st.integers(0, 3_000), c=st.integers(0, 3_000))
def test_matches_scipy_binomtest(b: int, c: int) -> None:
    result = mcnemar_exact(b, c)
    expected = 1.0 if b + c == 0 else sps.binomtest(b, b + c, 0.5).pvalue
    # scipy underflows to 0 below about 1e-279 (hypothesis found b=2, c=941: ours 3.7e-280,
    # scipy 0.0); the exact values down there are checked in test_stats_binomial.
    if expected == 0.0:
        assert 0.0 <= result.p_value < 1e-250
    else:
        assert result.p_value == pytest.approx(expected, rel=1e-9, abs=1e-280)
    assert (result.b, result.c, result.statistic, result.discordant) == (b, c, min(b, c), b + c)


def test_large_counts_match_scipy() -> None:
    result = mcnemar_exact(50_400, 49_600)
    assert result.p_value == pytest.approx(sps.binomtest(49_600, 100_000, 0.5).pvalue, rel=1e-9)
    assert 0.0 < result.p_value < 0.02


def test_no_discordant_pairs_gives_p_one() -> None:
    result = mcnemar_exact(0, 0)
    assert result.p_value == 1.0
    assert result.statistic == 0


def test_all_pairs_discordant_one_way() -> None:
    # Ten items, every one fixed: p = 2 * (1/2)^10.
    assert mcnemar_exact(0, 10).p_value == pytest.approx(2 * 0.5**10, rel=1e-14)
    assert mcnemar_exact(10, 0).p_value == mcnemar_exact(0, 10).p_value


def test_balanced_discordance_is_not_significant() -> None:
    assert mcnemar_exact(5, 5).p_value == 1.0


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="b must be >= 0"):
        mcnemar_exact(-1, 3)
    with pytest.raises(TypeError):
        mcnemar_exact(1.0, 3)  # type: ignore[arg-type]
