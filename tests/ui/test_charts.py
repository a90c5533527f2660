"""The SVG charts' text (issue 33): labels are shown whole, wrapped rather than cut with an
ellipsis; a histogram's ticks are distinct and read as its edges."""

from __future__ import annotations

import re

from replay_audit.stats.report import LiftReport, ProportionRead
from replay_audit.stats.summary import histogram
from replay_audit.ui.charts import category_chart, histogram_chart, lift_chart

LONG = "weight storage: fp16-stored, fp32 compute, deterministic algorithms off, batch 8"


def _words(svg: str) -> list[str]:
    return " ".join(re.findall(r"<tspan[^>]*>([^<]*)</tspan>", svg)).split()


def test_long_labels_wrap_whole_instead_of_ending_in_an_ellipsis() -> None:
    svg = str(category_chart({"short": ProportionRead.of(3, 4), LONG: ProportionRead.of(1, 4)}))
    assert "\u2026" not in svg
    assert _words(svg) == ["short", *LONG.split()]
    lift = LiftReport(
        run_a="a", comparison_a=0, run_b="a", comparison_b=1, label_a="base", label_b=LONG,
        n=20, ear_a=0.5, ear_b=0.9, lift=0.4, low=0.2, high=0.6, confidence=0.95,
        resamples=100, seed=0, fixed=8, broke=0, mcnemar_p=0.01, fixed_traces=[],
        broke_traces=[], fixed_more=False, broke_more=False,
    )  # fmt: skip
    svg = str(lift_chart([lift]))
    assert "\u2026" not in svg and _words(svg) == LONG.split()
    # Each line is its own tspan, one under the other.
    assert re.findall(r'<tspan x="[\d.]+" dy="([\d.]+)em"', svg) == ["0", "1.2", "1.2", "1.2"]


def _axis_ticks(svg: str, y: int) -> list[str]:
    return re.findall(rf'<text x="[\d.]+" y="{y}" class="axis-label"[^>]*>([^<]*)</text>', svg)


def test_a_histogram_of_shares_has_distinct_decimal_ticks() -> None:
    """The trigger-density histogram's ticks read '0, 0, 1' (edges cut to integers)."""
    shares = histogram([0.0, 1 / 6, 1 / 6, 1 / 3], [i / 20 for i in range(21)])
    svg = str(histogram_chart(shares, "trigger density (share of steps)"))
    assert _axis_ticks(svg, 176) == ["0", "0.5", "1"]
    assert "trigger density (share of steps) [0.15, 0.2): 2" in svg  # a bar's tooltip
    steps = str(histogram_chart(histogram([0, 3, 3, 11], 11, (0, 11)), "t*"))
    assert _axis_ticks(steps, 176) == ["0", "5", "11"] and "t* 3: 2" in steps
