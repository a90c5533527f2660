"""The screening report as HTML: the charts (`ui/charts.py`'s SVG helpers) and the context of
the `ui/screening_body.html` template, shared by the served page (`/ui/screenings/{id}`) and
the self-contained file the CLI writes (the stylesheet inlined, no external asset)."""

from __future__ import annotations

from markupsafe import Markup
from typing_extensions import TypedDict

from replay_audit.screenings.sweep.report import ScreeningReport
from replay_audit.stats.report import ProportionRead
from replay_audit.stats.summary import histogram
from replay_audit.ui.charts import (
    Series,
    category_chart,
    histogram_chart,
    lift_chart,
    log_histogram_chart,
    margin_at_divergence_chart,
)
from replay_audit.ui.templating import ENV, STATIC_DIR


class Context(TypedDict):
    """What the screening templates render: the report and its charts (None: nothing to draw)."""

    report: ScreeningReport
    sweep_chart: Markup | None
    category_chart: Markup
    lift_chart: Markup | None
    margin_charts: list[Markup]
    td_chart: Markup | None
    pair_margin_chart: Markup


def context(report: ScreeningReport) -> Context:
    sweep: dict[str, ProportionRead] = {}
    for k in report.knobs:
        for v in k.values:
            if v.comparison is not None:
                sweep[f"{k.name}: {v.label}"] = v.comparison.ear
    pair = report.head_vs_body
    margin_charts: list[Markup] = []
    for m in report.margins[:3]:
        margin_charts.append(
            log_histogram_chart(
                [Series(m.label, m.histogram, "series-logged")],
                f"every step's top-2 margin, {m.label} ({m.head_format} head)",
            )
        )
    td = next((d for d in report.trigger_density if d.cv is not None), None)
    td = td or (report.trigger_density[0] if report.trigger_density else None)
    return {
        "report": report,
        "sweep_chart": category_chart(sweep) if sweep else None,
        "category_chart": category_chart(pair.baseline.categories),
        "lift_chart": lift_chart([pair.lift]) if pair.lift is not None else None,
        "margin_charts": margin_charts,
        "td_chart": (
            histogram_chart(
                histogram(td.per_prompt, [i / 20 for i in range(21)]) if td.per_prompt else None,
                "trigger density (share of steps)",
            )
            if td is not None
            else None
        ),
        "pair_margin_chart": margin_at_divergence_chart(pair.baseline.margin_at_divergence),
    }


def standalone_html(report: ScreeningReport) -> str:
    """The report as one HTML file: the UI's stylesheet inlined, charts as inline SVG, no
    script and no external asset."""
    css = (STATIC_DIR / "ui.css").read_text(encoding="utf-8")
    return ENV.get_template("ui/screening_standalone.html").render(
        base="", css=Markup(css), **context(report)
    )
