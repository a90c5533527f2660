"""The verification's statistics, calibration and verdict (pure), on synthetic deficits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from replay_audit.diff.deficit import TIE_BAND_ULPS, token_deficits
from replay_audit.stats.verification import (
    STATISTICS,
    Calibration,
    auc,
    calibrate,
    deficit_bins,
    draw_group_scores,
    poisson_upper,
    verdict,
)

PLATFORM = {"device": "cpu", "gpu_name": None, "sm": None, "torch_version": None, "devices": 1}
CLAIM = {"dtype": "bf16", "lm_head_dtype": "bf16", "attn_kernel": "sdpa"}


def _traces(rng: np.random.Generator, n: int, p_mismatch: float, big: bool) -> list[np.ndarray]:
    """n traces of 40 tokens: deficits 0, else 1 ulp (benign) or 2..30 ulps (`big`)."""
    out = []
    for _ in range(n):
        hit = rng.random(40) < p_mismatch
        size = rng.integers(2, 31, 40) if big else np.ones(40)
        out.append(np.where(hit, size, 0).astype(np.float64))
    return out


@pytest.fixture(scope="module")
def calibration() -> Calibration:
    rng = np.random.default_rng(0)
    null = {"bf16": _traces(rng, 30, 0.01, False), "fp16": _traces(rng, 30, 0.02, False)}
    alt = _traces(rng, 30, 0.08, True)
    return calibrate(
        null,
        alt,
        weights_sha256="x",
        claim={"dtype": "bf16", "lm_head_dtype": "bf16", "attn_kernel": "sdpa"},
        platform={
            "device": "cpu",
            "gpu_name": None,
            "sm": None,
            "torch_version": None,
            "devices": 1,
        },
        draws=300,
    )


def test_deficits_are_exact_in_ulps_and_banded() -> None:
    d = token_deficits([16.0, 16.0, 16.0], [16.0, 15.875, 15.0], [0, 1, 4], "bf16")
    assert d.deficit.tolist() == [0.0, 0.125, 1.0]
    assert d.deficit_ulps.tolist() == [0.0, 1.0, 8.0]
    assert d.in_tie_band.tolist() == [True, True, TIE_BAND_ULPS >= 8.0]


def test_bins_separate_zero_rounding_and_large() -> None:
    assert deficit_bins([0.0, 0.5, 1.0, 3.0, 10.0, 100.0]).tolist() == [0, 1, 1, 2, 3, 5]


def test_group_draws_have_exactly_the_budget() -> None:
    ones = [np.ones(7), np.ones(3)]
    assert (draw_group_scores(ones, 50, 20, np.random.default_rng(1)) == 1.0).all()


def test_thresholds_hold_the_false_alarm_rate_and_shrink_with_tokens(
    calibration: Calibration,
) -> None:
    for stat in STATISTICS:
        rows = calibration.budgets[stat]
        assert all(r.false_alarm <= calibration.false_alarm_rate for r in rows)
        assert rows[-1].threshold <= rows[0].threshold
        powers = [r.power or 0.0 for r in rows]
        assert powers[-1] >= powers[0] and powers[-1] > 0.95


def test_every_benign_variation_keeps_the_false_alarm_rate_not_just_their_mix() -> None:
    """Three quiet variations and a noisy one (2.5 times the rounding-level flips, all inside the
    tie band). A provider's group comes from one configuration: honest groups of the noisy one
    stay under the threshold at the promised rate, which the noisy variation sets. Thresholds
    from groups drawn over the pooled traces of all four let it trip them several times over."""
    rng = np.random.default_rng(3)
    null = {f"quiet{i}": _traces(rng, 40, 0.02, False) for i in range(3)}
    null["noisy"] = _traces(rng, 40, 0.05, False)
    cal = calibrate(null, [], weights_sha256="x", claim=CLAIM, platform=PLATFORM, draws=400)  # type: ignore[arg-type]
    assert cal.version >= 2  # thresholds per variation
    fresh = _traces(np.random.default_rng(4), 200, 0.05, False)  # the noisy one, other traces
    for stat in ("mean_deficit_ulps", "log_likelihood_ratio"):
        for row in cal.budgets[stat]:
            if row.tokens < 128 or row.tokens > 2048:
                continue
            assert row.set_by == "noisy", (stat, row.tokens)
            groups = draw_group_scores(
                [cal.scorer.scores(u, stat) for u in fresh],
                row.tokens,
                400,
                rng,  # type: ignore[arg-type]
            )
            assert (groups > row.threshold).mean() <= 0.03, (stat, row.tokens)
            # The old way: the same quantile of groups drawn from the pooled traces.
            pooled = [cal.scorer.scores(u, stat) for t in null.values() for u in t]  # type: ignore[arg-type]
            mixed = np.quantile(draw_group_scores(pooled, row.tokens, 400, rng), 0.99)
            assert (groups > mixed).mean() > 0.05, (stat, row.tokens)


def _heterogeneous(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """n traces of 48 tokens whose prompts differ: each flips at its own rate (most rarely, a
    few often), every flip a rounding-level 1 ulp."""
    return [np.where(rng.random(48) < rng.beta(0.5, 20), 1.0, 0.0) for _ in range(n)]


@pytest.mark.slow
def test_a_null_of_few_traces_keeps_its_promise_on_other_prompts_at_large_budgets() -> None:
    """Groups far larger than the null's tokens: drawn from the null's 48 traces themselves they
    would score those traces' mean almost exactly, and the threshold would sit just above it,
    so the next prompts' groups (another mean) would trip it often: 12% of them at 8,192 tokens
    over these 8 nulls (seeded). Drawn from a bootstrap resample of the traces for each group,
    the threshold holds the uncertainty of that mean, and groups of other prompts trip it near
    the promised 1%. (Over other seeds both vary widely: a null of 48 heterogeneous traces is
    small, and the bootstrap cuts the excess about threefold at 8,192 tokens, not to nothing.)"""
    rng = np.random.default_rng(0)
    population = [np.concatenate([[0.0], np.cumsum(t)]) for t in _heterogeneous(rng, 3000)]
    rates: dict[int, list[float]] = {2048: [], 8192: []}
    for trial in range(8):
        null = {"v": _heterogeneous(rng, 48)}
        cal = calibrate(
            null,
            [],
            weights_sha256="x",
            claim=CLAIM,
            platform=PLATFORM,  # type: ignore[arg-type]
            budgets=tuple(rates),
            draws=200,
            seed=trial,
        )
        for row in cal.budgets["mean_deficit_ulps"]:
            scores = []
            for _ in range(200):  # groups of other prompts: traces of the population
                left, total = row.tokens, 0.0
                while left > 0:
                    c = population[int(rng.integers(len(population)))]
                    take = min(left, c.size - 1)
                    total, left = total + c[take], left - take
                scores.append(total / row.tokens)
            rates[row.tokens].append(float((np.array(scores) > row.threshold).mean()))
    for tokens, r in rates.items():
        assert np.mean(r) <= 0.05, (tokens, r)


def test_verdicts(calibration: Calibration) -> None:
    rng = np.random.default_rng(5)
    needed = calibration.tokens_needed()
    assert needed is not None
    benign = verdict(_traces(rng, needed // 40 + 1, 0.015, False), calibration)
    assert benign.verdict == "consistent"
    tampered = verdict(_traces(rng, 20, 0.08, True), calibration)
    assert tampered.verdict == "inconsistent" and tampered.effect_size > 0
    assert tampered.closest_benign in {"bf16", "fp16"}
    few = verdict(_traces(rng, 1, 0.0, False)[:1], calibration)
    assert few.tokens < needed
    assert few.verdict == "insufficient" and few.more_tokens == needed - few.tokens


def test_calibration_round_trips_through_json(calibration: Calibration) -> None:
    again = Calibration.from_json(json.loads(json.dumps(calibration.to_json())))
    assert again == calibration


def test_auc() -> None:
    assert auc([0, 0, 1], [2, 3]) == 1.0
    assert auc([1, 1], [1, 1]) == 0.5


def test_the_poisson_upper_bound_is_the_exact_one() -> None:
    assert poisson_upper(0, 0.95) == pytest.approx(-math.log(0.05), rel=1e-6)  # the rule of three
    assert poisson_upper(5, 0.95) == pytest.approx(10.513, abs=1e-3)  # tables: 10.51
    bounds = [poisson_upper(k, 0.95) for k in range(20)]
    assert all(b > k for k, b in enumerate(bounds)) and bounds == sorted(bounds)


def test_a_null_that_saw_no_out_of_band_token_measures_what_it_can_promise() -> None:
    """A benign population in which one trace of 1,500 holds a token outside the tie band: a
    null of 1,536 of its traces may hold none, and then the draws' quantile, 0 at every budget,
    promises what it cannot keep: a provider's group of 131,072 honest tokens (distinct traces
    of the same population) holds such a token more often than not. The rare-event floor the
    calibration measures (a Poisson upper bound on the rate such traces come at) keeps the
    false-alarm rate at 1% there, and is 0 at a small budget, where such a trace is rarely in a
    group."""
    length, per_trace = 100, 1 / 1500
    null = {"a": [np.zeros(length) for _ in range(1536)]}
    cal = calibrate(
        null,
        [],
        weights_sha256="x",
        claim=CLAIM,
        platform=PLATFORM,
        budgets=(256, 131072),  # type: ignore[arg-type]
    )
    small, large = cal.budgets["outside_tie_band"]
    assert small.rare_event_floor == 0.0 and large.threshold == 0.0
    assert large.rare_event_floor is not None and large.rare_event_floor > 0.0
    assert all(b.rare_event_floor is None for b in cal.budgets["mean_deficit_ulps"])
    # honest groups of distinct traces: the out-of-band tokens in 1,310 traces
    held = np.random.default_rng(11).binomial(131072 // length, per_trace, size=20000)
    scores = held / 131072
    assert (scores > large.rare_event_floor).mean() <= 0.01
    assert (scores > large.threshold).mean() > 0.5  # what the quantile alone promised
    assert Calibration.from_json(cal.to_json()).budgets["outside_tie_band"][1] == large
