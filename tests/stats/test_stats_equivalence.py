"""Paired non-inferiority (TOST lower test) against an independent computation with
scipy.stats.norm, and the degenerate cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from replay_audit.stats import tost_noninferiority


def _arms(both: int, lost: int, gained: int, neither: int) -> tuple[list[bool], list[bool]]:
    """Per-item correctness for two arms from the four cells of the paired 2x2 table."""
    baseline = [True] * both + [True] * lost + [False] * gained + [False] * neither
    treated = [True] * both + [False] * lost + [True] * gained + [False] * neither
    return baseline, treated


def _reference(
    baseline: list[bool], treated: list[bool], margin: float, alpha: float, confidence: float
) -> tuple[float, float, float, float]:
    """Straight from the definitions, per-item: mean and variance of the paired differences
    (population variance / n is the Wald variance of a difference of paired proportions)."""
    d = np.asarray(treated, dtype=float) - np.asarray(baseline, dtype=float)
    n = d.size
    diff = d.mean()
    se = math.sqrt(d.var() / n)
    z = float(sps.norm.ppf((1 + confidence) / 2))
    p = float(sps.norm.sf((diff + margin) / se)) if se > 0 else float(diff <= -margin)
    return diff, p, max(-1.0, diff - z * se), min(1.0, diff + z * se)


@settings(max_examples=200, deadline=None)
@given(
    cells=st.tuples(*(st.integers(0, 400) for _ in range(4))).filter(lambda t: sum(t) > 0),
    margin=st.sampled_from([0.0, 0.01, 0.05, 0.1]),
    alpha=st.sampled_from([0.01, 0.05, 0.1]),
)
def test_matches_reference(cells: tuple[int, int, int, int], margin: float, alpha: float) -> None:
    baseline, treated = _arms(*cells)
    result = tost_noninferiority(baseline, treated, margin=margin, alpha=alpha)
    diff, p, low, high = _reference(baseline, treated, margin, alpha, 1 - 2 * alpha)
    assert result.diff == pytest.approx(diff, abs=1e-12)
    assert result.p_value == pytest.approx(p, rel=1e-9, abs=1e-15)
    assert result.low == pytest.approx(low, abs=1e-12)
    assert result.high == pytest.approx(high, abs=1e-12)
    assert result.non_inferior == (result.p_value < alpha)
    # The default interval is the one matching the test.
    if abs(result.low + margin) > 1e-9:
        assert result.non_inferior == (result.low > -margin)
    assert (result.lost, result.gained, result.n) == (cells[1], cells[2], sum(cells))


def test_matches_the_formula_in_counts() -> None:
    # b = 63 lost, c = 59 gained of n = 600 (counts chosen to match the paper's Qwen2.5-3B row:
    # accuracy diff -0.7 pp, 95 % CI [-4.3, +2.9] pp, TOST p = 0.009).
    baseline, treated = _arms(both=7, lost=63, gained=59, neither=471)
    result = tost_noninferiority(baseline, treated, margin=0.05, confidence=0.95)
    b, c, n = 63, 59, 600
    se = math.sqrt((b + c - (b - c) ** 2 / n) / n**2)
    assert result.standard_error == pytest.approx(se, rel=1e-14)
    assert result.diff == pytest.approx(-4 / 600)
    assert round(result.p_value, 3) == 0.009
    assert (round(100 * result.low, 1), round(100 * result.high, 1)) == (-4.3, 2.9)
    assert result.non_inferior
    assert result.confidence == 0.95


def test_not_non_inferior_when_the_loss_is_large() -> None:
    baseline, treated = _arms(both=40, lost=30, gained=5, neither=25)
    result = tost_noninferiority(baseline, treated, margin=0.05)
    assert result.diff == pytest.approx(-0.25)
    assert result.p_value > 0.99
    assert not result.non_inferior
    assert result.low < -0.05


def test_no_discordant_pairs_is_degenerate_non_inferior() -> None:
    baseline, treated = _arms(both=30, lost=0, gained=0, neither=70)
    result = tost_noninferiority(baseline, treated)
    assert (result.diff, result.standard_error, result.p_value) == (0.0, 0.0, 0.0)
    assert result.non_inferior
    assert (result.low, result.high) == (0.0, 0.0)


def test_all_items_lost_is_degenerate_inferior() -> None:
    baseline, treated = _arms(both=0, lost=12, gained=0, neither=0)
    result = tost_noninferiority(baseline, treated)
    assert (result.diff, result.standard_error, result.p_value) == (-1.0, 0.0, 1.0)
    assert not result.non_inferior


def test_all_items_gained() -> None:
    baseline, treated = _arms(both=0, lost=0, gained=9, neither=0)
    result = tost_noninferiority(baseline, treated)
    assert (result.diff, result.p_value, result.non_inferior) == (1.0, 0.0, True)


def test_bad_arguments_are_refused() -> None:
    baseline, treated = _arms(both=3, lost=1, gained=1, neither=3)
    with pytest.raises(ValueError, match="margin"):
        tost_noninferiority(baseline, treated, margin=-0.1)
    with pytest.raises(ValueError, match="margin"):
        tost_noninferiority(baseline, treated, margin=float("nan"))
    with pytest.raises(ValueError, match="alpha"):
        tost_noninferiority(baseline, treated, alpha=0.5)
    with pytest.raises(ValueError, match="confidence"):
        tost_noninferiority(baseline, treated, confidence=1.0)
    with pytest.raises(ValueError, match="empty"):
        tost_noninferiority([], [])
    with pytest.raises(ValueError, match="differ"):
        tost_noninferiority([True], [True, True])
