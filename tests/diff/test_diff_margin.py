"""Margins, ulps and the gate. ulps are checked against torch.finfo (torch only in this test)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from replay_audit.diff import GateRule, is_tie, margin, margin_from_top_k, ulp_array
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
