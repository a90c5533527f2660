"""Sampling policies: reproducibility, stratification proportions, low-margin weighting."""

from __future__ import annotations

import random
from collections import Counter
from datetime import UTC, datetime

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from replay_audit.audits.sampling import (
    Candidate,
    largest_remainder,
    min_logged_margin,
    presample,
    sample,
    sample_seed,
    weight,
)

DUE = datetime(2026, 5, 10, 2, tzinfo=UTC)


def pool(n: int, strata: list[tuple[str, str]] | None = None) -> list[Candidate]:
    strata = strata or [("m", "c")]
    return [Candidate(i, f"tr_{i:06d}", strata[i % len(strata)]) for i in range(n)]


@pytest.mark.parametrize("policy", ["uniform", "stratified", "low_margin_first"])
def test_same_seed_same_data_same_sample(policy: str) -> None:
    cands = [
        Candidate(c.trace_id, c.public_id, c.stratum, min_margin=(c.trace_id % 13) / 10)
        for c in pool(500, [("a", "x"), ("b", "y"), ("a", "y")])
    ]
    seed = sample_seed(7, DUE)
    first = sample(cands, 40, policy, seed)  # type: ignore[arg-type]
    shuffled = cands[:]
    random.Random(1).shuffle(shuffled)
    again = sample(shuffled, 40, policy, seed)  # type: ignore[arg-type]
    assert [c.public_id for c in first] == [c.public_id for c in again]
    assert len(first) == 40 and len({c.public_id for c in first}) == 40
    assert [c.public_id for c in first] == sorted(c.public_id for c in first)
    # Another seed, or another due time of the same schedule, draws another sample.
    other_seed = sample(cands, 40, policy, sample_seed(8, DUE))  # type: ignore[arg-type]
    next_night = sample(cands, 40, policy, sample_seed(7, DUE.replace(day=11)))  # type: ignore[arg-type]
    assert {c.public_id for c in other_seed} != {c.public_id for c in first}
    assert {c.public_id for c in next_night} != {c.public_id for c in first}


def test_uniform_is_stable_when_the_window_grows() -> None:
    """A late-ingested trace changes at most one member of a uniform sample."""
    cands = pool(300)
    seed = sample_seed(1, DUE)
    before = {c.public_id for c in sample(cands, 30, "uniform", seed)}
    after = {
        c.public_id
        for c in sample([*cands, Candidate(999, "tr_x", ("m", "c"))], 30, "uniform", seed)
    }
    assert len(before - after) <= 1


def test_uniform_is_uniform() -> None:
    """Over many due times each trace is picked about equally often."""
    cands = pool(50)
    counts: Counter[str] = Counter()
    for night in range(400):
        for c in sample(cands, 10, "uniform", sample_seed(night, DUE)):
            counts[c.public_id] += 1
    expected = 400 * 10 / 50
    assert set(counts) == {c.public_id for c in cands}
    assert all(abs(n - expected) < 0.4 * expected for n in counts.values())


def test_small_windows_and_sizes() -> None:
    seed = sample_seed(0, DUE)
    assert sample([], 10, "uniform", seed) == []
    assert len(sample(pool(5), 10, "stratified", seed)) == 5  # everything, when fewer
    assert sample(pool(5), 0, "uniform", seed) == []


def test_stratified_proportions() -> None:
    strata = (
        [("llama", "bf16-a100")] * 5 + [("llama", "fp16-h100")] * 3 + [("qwen", "bf16-a100")] * 2
    )
    cands = pool(1000, strata)
    got = Counter(c.stratum for c in sample(cands, 100, "stratified", sample_seed(3, DUE)))
    assert got == {
        ("llama", "bf16-a100"): 50,
        ("llama", "fp16-h100"): 30,
        ("qwen", "bf16-a100"): 20,
    }


def test_stratified_keeps_a_rare_stratum_that_uniform_may_miss() -> None:
    cands = pool(990, [("common", "c")]) + [
        Candidate(10_000 + i, f"tr_rare_{i}", ("rare", "c")) for i in range(10)
    ]
    got = Counter(c.stratum for c in sample(cands, 100, "stratified", sample_seed(5, DUE)))
    assert got == {("common", "c"): 99, ("rare", "c"): 1}


def test_largest_remainder_example() -> None:
    # Exact shares 3.5, 1.0, 0.5: floors 3, 1, 0; the seat left goes to the largest remainder,
    # a tie (0.5 and 0.5) broken in favour of the larger stratum.
    assert largest_remainder({"a": 7, "b": 2, "c": 1}, 5) == {"a": 4, "b": 1, "c": 0}
    assert largest_remainder({"a": 1, "b": 1, "c": 1}, 2) == {"a": 1, "b": 1, "c": 0}
    assert largest_remainder({"a": 3, "b": 2}, 10) == {"a": 3, "b": 2}


@given(
    counts=st.dictionaries(
        st.text(min_size=1, max_size=3), st.integers(1, 500), min_size=1, max_size=12
    ),
    frac=st.floats(0, 1),
)
def test_largest_remainder_properties(counts: dict[str, int], frac: float) -> None:
    total = sum(counts.values())
    size = round(frac * total)
    q = largest_remainder(counts, size)
    assert sum(q.values()) == size
    for key, n in counts.items():
        exact = size * n / total
        assert int(np.floor(exact)) <= q[key] <= int(np.ceil(exact))
        assert 0 <= q[key] <= n


def test_min_logged_margin_from_packed_logits() -> None:
    logits = np.array([[10.0, 9.0, 1.0], [5.0, 4.875, 4.0], [3.0, 1.0, 0.5]], dtype=np.float32)
    assert min_logged_margin(logits.ravel(), 3) == pytest.approx(0.125)
    # Unsorted rows are read correctly too.
    assert min_logged_margin(np.array([1.0, 3.0, 2.0, 2.5], dtype=np.float32), 2) == pytest.approx(
        0.5
    )
    assert min_logged_margin(np.array([4.0, 4.0], dtype=np.float32), 2) == 0.0  # a tie
    assert min_logged_margin(None, None) is None
    assert min_logged_margin(np.array([1.0, 2.0], dtype=np.float32), 1) is None  # top-1 only


def test_low_margin_first_prefers_low_margin_traces() -> None:
    """50 of 1000 traces came within 1e-4 of a flip; the others had a margin of 2 logits. The
    low-margin policy picks mostly the close calls, uniform about its 5% share of them."""
    cands = [
        Candidate(i, f"tr_{i:06d}", ("m", "c"), min_margin=1e-4 if i % 20 == 0 else 2.0)
        for i in range(1000)
    ]
    close = {c.public_id for c in cands if c.min_margin == 1e-4}
    for night in range(5):
        seed = sample_seed(night, DUE)
        low = {c.public_id for c in sample(cands, 50, "low_margin_first", seed)}
        uni = {c.public_id for c in sample(cands, 50, "uniform", seed)}
        assert len(low & close) >= 45
        assert len(uni & close) <= 12
    # Weights are monotone: the smaller the margin, the heavier.
    assert weight(0.0) > weight(1e-3) > weight(0.125) > weight(2.0) > 0


def test_low_margin_first_gives_traces_without_top_k_a_neutral_weight() -> None:
    """Unknown margins weigh the median: picked less often than close calls, more often than
    safe traces."""
    cands = (
        [Candidate(i, f"tr_a{i:04d}", ("m", "c"), min_margin=0.01) for i in range(300)]
        + [Candidate(i, f"tr_b{i:04d}", ("m", "c"), min_margin=0.5) for i in range(300, 600)]
        + [Candidate(i, f"tr_c{i:04d}", ("m", "c"), min_margin=3.0) for i in range(600, 900)]
        + [Candidate(i, f"tr_d{i:04d}", ("m", "c"), min_margin=None) for i in range(900, 1200)]
    )
    picked: Counter[str] = Counter()
    for night in range(20):
        for c in sample(cands, 100, "low_margin_first", sample_seed(night, DUE)):
            picked[c.public_id[3]] += 1
    assert picked["a"] > picked["d"] > picked["c"]
    assert picked["d"] == pytest.approx(picked["b"], rel=0.35)  # the median weight is b's


def test_presample_is_independent_of_the_sample_keys() -> None:
    cands = pool(5000)
    seed = sample_seed(2, DUE)
    sub = presample(cands, 500, seed)
    assert len(sub) == 500
    assert presample(cands, 500, seed) == sub
    assert presample(cands[:100], 500, seed) == cands[:100]
    # Not simply the uniform sample's first members.
    assert {c.public_id for c in sample(cands, 100, "uniform", seed)} - {c.public_id for c in sub}
