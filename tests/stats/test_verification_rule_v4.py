"""Issue 34: the decision per budget of calibration version 4, against the two flaws that the
H200 SmolLM2 null (1.6 M benign tokens, BENCHMARKS.md) showed in version 3's:

- **over the rate at 512 and 1,024 tokens**: the tie band's threshold there rests on the few
  out-of-band traces the null happened to catch; half A's own split saw it within the
  allowance (untrusted: a small-batch variation's halves hold few traces) and kept it, and the
  other half's groups tripped it on 1.5% and 2.6%;
- **power falling as the budget grows**: from 2,048 tokens the choice took the tie band at its
  rare-event floor (every candidate's power against the 4-bit alternative was 1.0, and the
  floor came first), whose floor the batch-1 variation of 4 prompts set high, so temperature
  0.3 sent as greedy, detected from 256 tokens, fell to a power of 0.07-0.10.

Both are reproduced on a synthetic population: two large variations that caught two
out-of-band traces each where the population holds one in 300 (five expected), and a
variation of 6 traces.
The chosen decisions are judged on fresh honest groups of distinct population traces (as a
provider's come) and on a temperature-like provider's groups. The names imported are
version 3's too, so that the file runs (and fails) against it. Pure."""

from __future__ import annotations

import numpy as np
import pytest

from replay_audit.stats.verification import (
    CANDIDATES,
    Calibration,
    Ulps,
    calibrate,
    draw_groups,
    flags,
    verdict,
)
from tests.stats.verification_inputs import CLAIM, PLATFORM

L = 100  # tokens a trace
P_OFF = 1 / 300  # the population's traces holding an out-of-band cluster
CLUSTER = 2  # its tokens
BUDGETS = (64, 256, 512, 1024, 4096, 16384, 65536)
FRESH = 3000
RATE = 0.01


def _honest(rng: np.random.Generator, n: int, off: list[int] | None = None) -> list[Ulps]:
    """Honest traces: rounding flips (1-3 ulps, inside the tie band) at a rate of each trace's
    own; a trace in 300 holds 2 tokens of 5-8 ulps. `off`: exactly these traces do (a null's
    unlucky catch: 2 of 1,536 where 5 are expected)."""
    out = []
    for r in rng.beta(0.5, 150, n):
        out.append(np.where(rng.random(L) < r, rng.choice([1.0, 1.0, 2.0, 3.0], L), 0.0))
    hit = np.flatnonzero(rng.random(n) < P_OFF) if off is None else np.asarray(off)
    for i in hit:
        out[i][rng.choice(L, CLUSTER, replace=False)] = rng.integers(5, 9, CLUSTER)
    return out


def _provider(rng: np.random.Generator, n: int, big: float, small: float) -> list[Ulps]:
    """A provider off the claim: tokens far outside the band (5-64 ulps) at `big`, in-band
    flips (2-4 ulps) at `small`. 4-bit-like at (0.06, 0.05); temperature-0.3-like (a sampled
    token now and then, far below the reference's top-1) at (0.01, 0.004)."""
    out = []
    for _ in range(n):
        u = np.where(rng.random(L) < big, rng.integers(5, 64, L).astype(np.float64), 0.0)
        out.append(np.where((u == 0) & (rng.random(L) < small), rng.choice([2.0, 3.0, 4.0], L), u))
    return out


@pytest.fixture(scope="module")
def setting() -> tuple[Calibration, list[Ulps], list[Ulps]]:
    rng = np.random.default_rng(3)
    null = {
        "bf16 b256": _honest(rng, 1536, off=[700, 1200]),
        "fp16 b256": _honest(rng, 1536, off=[300, 901]),
        "bf16 b1": _honest(rng, 6, off=[]),
    }
    cal = calibrate(
        null,
        _provider(rng, 300, 0.06, 0.05),
        weights_sha256="x",
        claim=CLAIM,
        platform=PLATFORM,
        budgets=BUDGETS,  # type: ignore[arg-type]
        seed=1,
    )
    population = _honest(np.random.default_rng(10), 20000)
    temperature = _provider(np.random.default_rng(11), 2000, 0.01, 0.004)
    return cal, population, temperature


def _flagged(
    cal: Calibration, traces: list[Ulps], budget: int, thresholds: dict[str, float]
) -> float:
    """The share of `FRESH` groups of `budget` distinct `traces` that `thresholds` flag."""
    rng = np.random.default_rng(budget)
    scores = {s: [cal.scorer.scores(u, s) for u in traces] for s in thresholds}
    groups = draw_groups(scores, budget, FRESH, rng, distinct=True)
    return float(flags(thresholds, groups).mean())  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_choice_keeps_the_rate_where_the_null_caught_too_few_rare_events(
    setting: tuple[Calibration, list[Ulps], list[Ulps]],
) -> None:
    cal, population, _ = setting
    assert [c.tokens for c in cal.choices] == list(BUDGETS)
    assert all(c.decision in CANDIDATES for c in cal.choices)
    # The pathology: the plain tie band's thresholds (two out-of-band traces in 1,536 per
    # variation) trip fresh honest groups over the allowance at large budgets.
    plain = {b.tokens: b.threshold for b in cal.budgets["outside_tie_band"] if b.tokens >= 512}
    tripped = {n: _flagged(cal, population, n, {"outside_tie_band": t}) for n, t in plain.items()}
    assert max(tripped.values()) > 0.015, tripped
    # What was chosen keeps the rate at every budget (3,000 fresh groups: about 0.2% of
    # sampling error at 1%).
    fresh = {c.tokens: _flagged(cal, population, c.tokens, c.thresholds) for c in cal.choices}
    assert max(fresh.values()) <= RATE + 0.004, fresh


@pytest.mark.slow
def test_a_provider_detected_at_a_budget_stays_detected_at_every_larger_one(
    setting: tuple[Calibration, list[Ulps], list[Ulps]],
) -> None:
    cal, _, temperature = setting
    power = {c.tokens: _flagged(cal, temperature, c.tokens, c.thresholds) for c in cal.choices}
    detected = [b for b, p in power.items() if p >= 0.95]
    assert detected and detected[0] <= 1024, power
    assert all(power[b] >= 0.95 for b in BUDGETS if b >= detected[0]), power


def test_a_version_3_calibration_keeps_loading_and_deciding_by_its_stored_choices(
    setting: tuple[Calibration, list[Ulps], list[Ulps]],
) -> None:
    cal, population, _ = setting
    stored = cal.to_json()
    # Version 3's form: no rare-event guard, the combined rule among its candidates.
    rule = {"outside_tie_band": 0.0, "mean_deficit_ulps": 1.0}
    for c in stored["choices"]:
        del c["rare_event_guard"]
        c["held_out_false_alarm"] = {"tie_band_or_mean_deficit": 0.0}
        c.update(decision="tie_band_or_mean_deficit", thresholds=rule)
    old = Calibration.from_json({**stored, "version": 3})
    assert old.version == 3 and all(c.rare_event_guard is None for c in old.choices)
    assert old.decision_at(20000) == ("tie_band_or_mean_deficit", rule)
    # An honest group holding one out-of-band cluster: over the stored tie band's 0.
    group = [u for u in population if (u > 4).any()][:1] + population[:199]
    v = verdict(group, old)
    assert v.verdict == "inconsistent" and v.decision == "tie_band_or_mean_deficit"
    assert v.decided_by == "outside_tie_band" and v.threshold == 0.0
