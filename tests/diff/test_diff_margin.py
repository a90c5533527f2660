"""Margins, ulps and the gate. ulps are checked against torch.finfo (torch only in this test)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_audit.diff import (
    GateRule,
    first_near_tie,
    is_tie,
    margin,
    margin_from_top_k,
    margins_ulps_from_top_k,
    sort_top_k,
    step_numerics,
    ulp_array,
)
from replay_audit.formats import ulp

TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("x", [1.0, 1.5, 3.0, 16.0, 17.25, 100.0, 1000.0, 0.3, -16.0, -0.01])
def test_ulp_matches_torch_finfo_and_nextafter(fmt: str, x: float) -> None:
    dt = TORCH[fmt]
    fi = torch.finfo(dt)
    e = max(math.frexp(abs(x))[1] - 1, math.frexp(fi.smallest_normal)[1] - 1)
    assert ulp(x, fmt) == fi.eps * 2.0**e
    # the spacing of representable numbers just above a representable |x|
    v = torch.tensor(abs(x), dtype=dt)
    up = torch.nextafter(v, torch.tensor(math.inf, dtype=dt))
    assert float(up) - float(v) == ulp(float(v), fmt)
    assert float(ulp_array([x], fmt)[0]) == ulp(x, fmt)


def test_bf16_ulp_at_16_is_an_eighth() -> None:
    assert ulp(16.0, "bf16") == 0.125
    assert margin(16.0, 15.875, "bf16").ulps == 1.0
    assert ulp(16.0, "fp16") == 2.0**-6
    assert ulp(0.0, "fp16") == 2.0**-24  # subnormal spacing
    assert ulp(300.0, "fp8_e4m3") == 32.0


def test_ulp_array_matches_scalar_ulp_everywhere() -> None:
    xs = np.array([0.0, 1e-30, 1e-6, 0.5, 1.0, 2.0**20, -7.75, np.inf])
    for fmt in ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"):
        got = ulp_array(xs, fmt)
        assert list(got) == [ulp(float(x), fmt) for x in xs]


def test_margin_from_top_k_uses_the_first_two_logits() -> None:
    m = margin_from_top_k([12.5, 12.0, 3.0], "bf16")
    assert m.abs == 0.5 and m.ulps == 0.5 / 0.0625 and m.top1 == 12.5
    with pytest.raises(ValueError, match="top-2"):
        margin_from_top_k([1.0], "bf16")


def test_ties() -> None:
    assert is_tie(margin(3.0, 3.0, "fp16"))
    assert is_tie(None, margin(3.0, 3.0, "fp16"))
    assert not is_tie(margin(3.0, 2.5, "fp16"), None)
    assert not is_tie()


def test_gate_absolute_ungated_and_never() -> None:
    g = GateRule(tau=1e-3)
    assert g.fires(5e-4, 10.0, "bf16") and not g.fires(1e-3, 10.0, "bf16")
    assert g.fires(0.0, 10.0, "bf16")
    ungated = GateRule(tau=0.0)
    assert ungated.fires(1e6, 10.0, "bf16") and ungated.ungated
    never = GateRule(tau=-1.0)
    assert not never.fires(0.0, 10.0, "bf16")
    arr = never.fires_array([0.0, 1.0], [1.0, 1.0], "bf16")
    assert not arr.any()
    assert ungated.fires_array([0.0, 1.0], [1.0, 1.0], "bf16").all()


def test_gate_in_ulps_scales_with_the_format() -> None:
    g = GateRule(tau=123.0, tau_ulps=2.0)  # tau is ignored when tau_ulps is set
    # at top-1 = 16: bf16 ulp 0.125, fp16 ulp 1/64
    assert g.threshold(16.0, "bf16") == 0.25
    assert g.fires(0.2, 16.0, "bf16")
    assert not g.fires(0.2, 16.0, "fp16")
    assert list(g.fires_array([0.2, 0.2], [16.0, 16.0], "fp16")) == [False, False]
    assert GateRule(tau_ulps=0.0).ungated


# --- step_numerics: the per-step numerics decided once -----------------------------------------

HEADS = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")


@st.composite
def top_k_rows(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """(T, k) float32 logits drawn from a small pool (so rows have ties) and distinct ids per row,
    in no particular order."""
    t = draw(st.integers(1, 12))
    k = draw(st.integers(2, 8))
    pool = draw(
        st.lists(st.floats(-300.0, 300.0, width=32, allow_subnormal=True), min_size=1, max_size=4)
    )
    logits = np.asarray(
        draw(
            st.lists(
                st.lists(st.sampled_from(pool), min_size=k, max_size=k), min_size=t, max_size=t
            )
        ),
        dtype=np.float32,
    )
    ids = np.stack(
        [np.asarray(draw(st.permutations(range(1000, 1000 + 3 * k)))[:k]) for _ in range(t)]
    ).astype(np.int64)
    return ids, logits


@settings(max_examples=200, deadline=None)
@given(top_k_rows(), st.sampled_from(HEADS))
def test_step_numerics_orders_ties_by_smaller_id_and_margins_are_exact(
    rows: tuple[np.ndarray, np.ndarray], fmt: str
) -> None:
    ids, logits = rows
    n = step_numerics(logits, ids, head_format=fmt)
    assert n.top_k_logits.dtype == np.float32
    for t in range(len(ids)):
        # the same (id, logit) pairs, by logit descending then id ascending
        want = sorted(
            zip(ids[t].tolist(), logits[t].tolist(), strict=True), key=lambda p: (-p[1], p[0])
        )
        assert list(zip(n.top_k_ids[t].tolist(), n.top_k_logits[t].tolist(), strict=True)) == want
        top1, top2 = want[0][1], want[1][1]
        # the float64 difference of the float32 values, bit for bit
        assert n.margins[t : t + 1].tobytes() == (np.float64(top1) - np.float64(top2)).tobytes()
        if all(x == 0.0 or 2.0**-19 <= abs(x) <= 2.0**9 for x in (top1, top2)):
            # 24-bit significands at most 28 binades apart: float64 holds the difference exactly
            assert Fraction(float(n.margins[t])) == Fraction(top1) - Fraction(top2)
        assert float(n.top1[t]) == top1
        assert n.margins_ulps is not None
        assert float(n.margins_ulps[t]) == float(n.margins[t]) / ulp(top1, fmt)
        assert n.margin_at(t) == margin(top1, top2, fmt)
    # one step at a time (the decode) is the same as all steps at once (the scan)
    for t in range(len(ids)):
        one = step_numerics(logits[t : t + 1], ids[t : t + 1], head_format=fmt)
        assert np.array_equal(one.top_k_ids[0], n.top_k_ids[t])
        assert one.margins.tobytes() == n.margins[t : t + 1].tobytes()


@settings(max_examples=200, deadline=None)
@given(top_k_rows(), st.sampled_from(HEADS), st.floats(1e-6, 10.0), st.floats(0.25, 8.0))
def test_step_numerics_gate_absolute_and_format_scaled(
    rows: tuple[np.ndarray, np.ndarray], fmt: str, tau: float, k_ulps: float
) -> None:
    ids, logits = rows
    absolute = step_numerics(logits, ids, head_format=fmt, gate=GateRule(tau=tau))
    assert absolute.gate_fired is not None
    assert list(absolute.gate_fired) == [float(m) < tau for m in absolute.margins]
    scaled = step_numerics(logits, ids, head_format=fmt, gate=GateRule(tau=tau, tau_ulps=k_ulps))
    assert scaled.gate_fired is not None
    want = [
        float(m) < k_ulps * ulp(float(t1), fmt)
        for m, t1 in zip(scaled.margins, scaled.top1, strict=True)
    ]
    assert list(scaled.gate_fired) == want
    # the scalar rule is the same rule
    assert want == [
        GateRule(tau_ulps=k_ulps).fires(float(m), float(t1), fmt)
        for m, t1 in zip(scaled.margins, scaled.top1, strict=True)
    ]


@settings(max_examples=100, deadline=None)
@given(top_k_rows(), st.sampled_from(HEADS), st.floats(-10.0, -1e-9))
def test_step_numerics_tau_zero_fires_always_and_negative_never(
    rows: tuple[np.ndarray, np.ndarray], fmt: str, negative: float
) -> None:
    ids, logits = rows
    for always in (GateRule(tau=0.0), GateRule(tau=5.0, tau_ulps=0.0)):
        fired = step_numerics(logits, ids, head_format=fmt, gate=always).gate_fired
        assert fired is not None and fired.all()
    for never in (GateRule(tau=negative), GateRule(tau_ulps=negative)):
        fired = step_numerics(logits, ids, head_format=fmt, gate=never).gate_fired
        assert fired is not None and not fired.any()  # not even at a tie (margin 0)


def test_step_numerics_ties_and_shapes_by_hand() -> None:
    # a tie at the top: the smaller id first, margin 0, and the BF16 gate fires
    n = step_numerics(
        np.array([[2.0, 3.0, 3.0], [1.0, 0.5, 0.25]], np.float32),
        np.array([[4, 9, 7], [1, 2, 3]]),
        head_format="bf16",
        gate=GateRule(),
    )
    assert n.top_k_ids.tolist() == [[7, 9, 4], [1, 2, 3]]
    assert n.margins.tolist() == [0.0, 0.5] and n.margins_ulps is not None
    assert n.margins_ulps.tolist() == [0.0, 0.5 / ulp(1.0, "bf16")]
    assert n.gate_fired is not None and n.gate_fired.tolist() == [True, False]
    # one step as a 1-D row, no ids (positions stand in), no format: margins only
    bare = step_numerics([1.0, 3.0, 3.0])
    assert bare.top_k_ids.tolist() == [[1, 2, 0]] and bare.margins.tolist() == [0.0]
    assert bare.margins_ulps is None and bare.gate_fired is None
    # taken as ordered: the caller says which is top-1
    assert step_numerics([[2.5, 3.0]], sort=False).margins.tolist() == [-0.5]


def test_step_numerics_refuses_what_it_cannot_decide() -> None:
    with pytest.raises(ValueError, match="top-2"):
        step_numerics([[1.0], [2.0]])
    with pytest.raises(ValueError, match="shape"):
        step_numerics([[1.0, 2.0]], [[1, 2, 3]])
    with pytest.raises(ValueError, match="head format"):
        step_numerics([[1.0, 2.0]], gate=GateRule())
    with pytest.raises(ValueError, match="head format"):
        step_numerics([[1.0, 2.0]]).margin_at(0)


def test_sort_top_k_is_the_tie_rule() -> None:
    ids, vals = sort_top_k(np.array([[1.0, 2.0, 2.0, 2.0]], np.float32), [[5, 8, 3, 6]])
    assert ids.tolist() == [[3, 6, 8, 5]] and vals.dtype == np.float32


def test_first_near_tie_is_the_first_step_at_or_below_the_threshold() -> None:
    ulps = [5.0, float("nan"), 2.0, 1.0, 0.0]
    assert first_near_tie(ulps, 0) == 4  # 0: exact ties only
    assert first_near_tie(ulps, 1) == 3  # at the threshold counts
    assert first_near_tie(ulps, 4) == 2
    assert first_near_tie(ulps, 100) == 0  # NaN (unknown) is never a near-tie
    assert first_near_tie([float("nan")], 100) is None
    assert first_near_tie(ulps, -1) is None  # negative: off
    assert first_near_tie([], 1) is None


def test_logged_margins_in_ulps_of_the_logged_format() -> None:
    # BF16 at 16: one ulp is 0.125.
    top_k = [[16.0, 15.875, 1.0], [16.0, 15.5, 1.0], [16.0, 16.0, 1.0]]
    assert margins_ulps_from_top_k(top_k, "bf16").tolist() == [1.0, 4.0, 0.0]
    # Raw logprobs: the same differences, in ulps at the given top-1 logits.
    logprobs = [[-0.1, -0.225], [-0.2, -0.7]]
    got = margins_ulps_from_top_k(logprobs, "bf16", [16.0, 8.0])
    np.testing.assert_allclose(got, [0.125 / 0.125, 0.5 / 0.0625])
    with pytest.raises(ValueError, match="top-2"):
        margins_ulps_from_top_k([[1.0]], "bf16")
