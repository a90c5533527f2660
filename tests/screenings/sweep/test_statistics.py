"""The screening's statistics against independent computations on fixed inputs: CV(TD), the
covering τ, the Wilson interval of an EAR and the paired C lift."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from replay_audit.screenings.sweep.analysis import build_report
from replay_audit.screenings.sweep.density import (
    coefficient_of_variation,
    covering_tau,
    format_tau,
    trigger_density,
)
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig, build_plan
from replay_audit.screenings.sweep.runner import MemoryStore
from tests.screenings.sweep.fake_screen import HEAD, N_PROMPTS, STEPS, FakeBackend, prompts

Z95 = 1.959963984540054


def test_cv_is_population_std_over_mean() -> None:
    xs = [0.1, 0.0, 0.25, 0.05, 0.1]
    mean, std, cv = coefficient_of_variation(xs)
    assert mean == pytest.approx(statistics.fmean(xs))
    assert std == pytest.approx(statistics.pstdev(xs))
    assert cv == pytest.approx(statistics.pstdev(xs) / statistics.fmean(xs))
    assert coefficient_of_variation([0.0, 0.0])[2] is None  # no trigger anywhere: no CV
    assert coefficient_of_variation([0.3])[2] is None  # one prompt: no spread
    assert coefficient_of_variation([]) == (None, None, None)


def test_trigger_density_counts_strictly_below_tau() -> None:
    margins = np.array([0.0, 1e-4, 1e-3, 0.5, math.nan])
    assert trigger_density(margins, np.full(5, 1e-3)) == pytest.approx(2 / 5)
    assert trigger_density(np.zeros(0), np.zeros(0)) is None


def test_covering_tau_is_the_smallest_threshold_covering_the_share() -> None:
    flips = [0.5, 0.001, 0.02, 0.0, 0.3]
    for cover in (0.2, 0.4, 0.6, 0.8, 1.0):
        tau = covering_tau(flips, cover)
        assert tau is not None
        below = sum(1 for m in flips if m < tau)
        assert below / len(flips) >= cover - 1e-12
        # Any smaller threshold covers less.
        smaller = math.nextafter(tau, -math.inf)
        assert sum(1 for m in flips if m < smaller) / len(flips) < cover - 1e-12
    assert covering_tau([], 0.9) is None


def test_a_tau_covering_exact_ties_reads_as_just_above_zero() -> None:
    """The float after 0 (4.94e-324, a denormal) means 'gate the exact ties only' (issue 33)."""
    ties = covering_tau([0.0, 0.0, 0.3], 0.5)
    assert ties == 5e-324 and format_tau(ties) == "0⁺ (exact ties)"
    assert format_tau(covering_tau([0.0, 0.02], 1.0) or 0) == "0.02"
    assert format_tau(1e-300) == "1e-300"  # tiny, not a tie


def _report():
    plan = build_plan(
        Platform(device="cpu"),
        reference=ScreenConfig("fp32"),
        knobs=("body_dtype",),
        max_new_tokens=STEPS,
    )
    out = FakeBackend().run(plan, prompts(), MemoryStore())
    return build_report(plan, prompts(), out, model="fake", weights_sha256=None)


def test_ear_interval_is_wilson() -> None:
    ear = _report().head_vs_body.baseline.ear
    x, n = ear.successes, ear.n
    p = x / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 / (1 + Z95**2 / n) * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n))
    assert ear.low == pytest.approx(centre - half, abs=1e-12)
    assert ear.high == pytest.approx(centre + half, abs=1e-12)


def test_paired_lift_matches_an_independent_bootstrap() -> None:
    report = _report()
    lift = report.head_vs_body.lift
    assert lift is not None
    base = report.head_vs_body.baseline
    treated = report.head_vs_body.treated
    # Per-prompt exact flags rebuilt from the counts the fake makes by construction.
    exact_b = np.array([i not in (HEAD | {9, 10, 11}) for i in range(N_PROMPTS)])
    exact_c = np.array([i not in {9, 10, 11} for i in range(N_PROMPTS)])
    assert base.ear.successes == exact_b.sum() and treated.ear.successes == exact_c.sum()
    assert lift.lift == pytest.approx(exact_c.mean() - exact_b.mean())
    # An independent percentile bootstrap that resamples prompts (not the multinomial draw of
    # stats.paired): the intervals agree to bootstrap noise.
    rng = np.random.default_rng(12345)
    idx = rng.integers(0, N_PROMPTS, size=(20_000, N_PROMPTS))
    lifts = exact_c[idx].mean(axis=1) - exact_b[idx].mean(axis=1)
    low, high = np.quantile(lifts, [0.025, 0.975])
    assert lift.low == pytest.approx(low, abs=0.03)
    assert lift.high == pytest.approx(high, abs=0.03)
