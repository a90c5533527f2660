"""Charts as inline SVG, drawn on the server: no JavaScript, no external library, no network.

Each function returns `Markup` (safe to put in a template as is): every label that comes from
data is escaped here. Colours and fonts come from classes styled in `static/ui.css` (the
Content-Security-Policy forbids inline styles), so the charts follow the page's theme.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

from replay_audit.stats.report import LiftReport, MarginReport, ProportionRead
from replay_audit.stats.summary import Histogram, LogHistogram

WIDTH = 640
#: The width of a character of a 14 px label (system-ui; the size at a phone's width, 11 px
#: elsewhere), for laying labels out, and how far right a bar chart's labels may push its bars
#: (a longer label wraps); LINE_H: a label's line.
CHAR_W = 8.2
LABEL_MAX_X = 360
LINE_H = 15
#: Longest arm name in the margin track's legend (three entries share its one row).
LEGEND_CHARS = 30
#: Margins: left (axis labels), right, top, bottom (axis labels).
ML, MR, MT, MB = 56, 12, 14, 40


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _svg(height: int, body: list[str], label: str) -> Markup:
    return Markup(
        f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'aria-label="{escape(label)}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{escape(label)}</title>{''.join(body)}</svg>"
    )


def _text(x: float, y: float, text: object, cls: str = "axis-label", anchor: str = "middle") -> str:
    return (
        f'<text x="{_num(x)}" y="{_num(y)}" class="{cls}" text-anchor="{anchor}">'
        f"{escape(str(text))}</text>"
    )


def _wrap(text: str, fit: int) -> list[str]:
    """`text` in lines of at most `fit` characters, broken at spaces (a longer word is split)."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= fit:
            lines[-1] += " " + word
            continue
        while len(word) > fit:
            lines.append(word[:fit])
            word = word[fit:]
        lines.append(word)
    return lines


def _row_tops(labels: Sequence[Sequence[str]], min_h: int) -> list[int]:
    """Where each row of a chart of wrapped labels starts, then where the last one ends."""
    tops = [MT]
    for lines in labels:
        tops.append(tops[-1] + max(min_h, LINE_H * len(lines) + 10))
    return tops


def _label(x: float, y: float, lines: Sequence[str]) -> str:
    """A right-aligned label of `lines` (1.2 em apart: its font's size varies), centred on `y`."""
    top = y + 4 - (len(lines) - 1) * LINE_H / 2
    spans = "".join(
        f'<tspan x="{_num(x)}" dy="{1.2 if i else 0}em">{escape(line)}</tspan>'
        for i, line in enumerate(lines)
    )
    return f'<text y="{_num(top)}" class="axis-label" text-anchor="end">{spans}</text>'


def _rect(x: float, y: float, w: float, h: float, cls: str, tip: str) -> str:
    return (
        f'<rect x="{_num(x)}" y="{_num(y)}" width="{_num(max(w, 0))}" height="{_num(max(h, 0))}" '
        f'class="{cls}"><title>{escape(tip)}</title></rect>'
    )


def _line(x1: float, y1: float, x2: float, y2: float, cls: str) -> str:
    return f'<line x1="{_num(x1)}" y1="{_num(y1)}" x2="{_num(x2)}" y2="{_num(y2)}" class="{cls}"/>'


def _legend(entries: Sequence[tuple[str, str]], x1: float, y: float) -> list[str]:
    """(css key, text) entries right-aligned at `x1`, in order from left to right."""
    out, x = [], x1
    for key, text in reversed(entries):
        out.append(_text(x, y, text, f"legend legend-{key}", "end"))
        x -= CHAR_W * len(text) + 18
    return out


def _nice_max(value: int) -> int:
    if value <= 5:
        return max(value, 1)
    magnitude = int(10 ** math.floor(math.log10(value)))
    for step in (1, 2, 5, 10):
        if value <= step * magnitude:
            return step * magnitude
    return value


def _count_axis(body: list[str], top: int, height: int, y_max: int, x0: float, x1: float) -> None:
    base = height - MB
    for i in range(5):
        value = y_max * i / 4
        if i and value != int(value):
            continue
        y = base - (base - top) * i / 4
        body.append(_line(x0, y, x1, y, "grid"))
        body.append(_text(x0 - 6, y + 4, int(value), anchor="end"))


def _tick(x: float) -> str:
    """An axis value: a whole number as one, else to 4 significant digits (0.05, not 0)."""
    return str(int(x)) if x == int(x) else f"{x:.4g}"


def histogram_chart(hist: Histogram | None, x_label: str, height: int = 200) -> Markup:
    """Bars of a linear histogram (e.g. t*, or a share); whole-number bins are labelled by their
    integer range, others by their edges."""
    label = f"Histogram of {x_label}"
    if hist is None or not hist.counts:
        return _svg(60, [_text(WIDTH / 2, 34, "no divergent trace", "empty")], label)
    body: list[str] = []
    y_max = _nice_max(max(hist.counts))
    x0, x1, base = ML, WIDTH - MR, height - MB
    _count_axis(body, MT, height, y_max, x0, x1)
    n = len(hist.counts)
    width = (x1 - x0) / n
    for i, count in enumerate(hist.counts):
        lo, hi = hist.edges[i], hist.edges[i + 1]
        h = (base - MT) * count / y_max
        span = f"[{_tick(lo)}, {_tick(hi)})"
        if lo == int(lo) and hi == int(hi):
            span = f"{int(lo)}" if hi - lo <= 1 else f"{int(lo)}\u2013{int(hi) - 1}"
        body.append(
            _rect(x0 + i * width + 1, base - h, width - 2, h, "bar", f"{x_label} {span}: {count}")
        )
    ticks = {0, n // 2, n}
    for i in sorted(ticks):
        body.append(_text(x0 + i * width, base + 16, _tick(hist.edges[i])))
    body.append(_line(x0, base, x1, base, "axis"))
    body.append(_text((x0 + x1) / 2, height - 6, x_label))
    return _svg(height, body, label)


@dataclass(frozen=True)
class Series:
    """One data set of a grouped chart: a name for the legend, its data, a CSS class."""

    name: str
    hist: LogHistogram | None
    css: str


def _decade(edge: float) -> int | None:
    """The exponent of an edge that is a whole power of ten, else None."""
    exponent = math.log10(edge)
    return round(exponent) if abs(exponent - round(exponent)) < 1e-9 else None


def _edge_label(edge: float) -> str:
    d = _decade(edge)
    return f"1e{d}" if d is not None else f"{edge:.2g}"


def log_histogram_chart(series: Sequence[Series], x_label: str, height: int = 220) -> Markup:
    """Grouped bars of log-axis histograms sharing one axis (the margin at t* of both arms),
    with the exact zeros drawn as a separate group left of the axis break."""
    label = f"Histogram of {x_label} on a log axis"
    present = [s for s in series if s.hist is not None]
    if not present:
        return _svg(60, [_text(WIDTH / 2, 34, "no divergent trace", "empty")], label)
    edges = max((s.hist.edges for s in present if s.hist is not None), key=len)
    n_bins = max(len(edges) - 1, 0)
    groups = 1 + n_bins  # the zero group, then one per bin
    peak = max(
        max([s.hist.zeros, *s.hist.counts, s.hist.below, s.hist.above])
        for s in present
        if s.hist is not None
    )
    y_max = _nice_max(peak)
    body: list[str] = []
    x0, x1, base = ML, WIDTH - MR, height - MB - 14
    _count_axis(body, MT, height - 14, y_max, x0, x1)
    gap = 18  # the axis break between the zero group and the log bins
    width = (x1 - x0 - gap) / groups
    bar = (width - 4) / len(present)

    def group_x(g: int) -> float:
        return x0 + g * width + (gap if g else 0)

    for j, s in enumerate(present):
        assert s.hist is not None
        values = [s.hist.zeros, *s.hist.counts] if s.hist.edges else [s.hist.zeros]
        for g, count in enumerate(values):
            h = (base - MT) * count / y_max
            where = (
                "exactly 0" if g == 0 else f"[{_edge_label(edges[g - 1])}, {_edge_label(edges[g])})"
            )
            body.append(
                _rect(
                    group_x(g) + 2 + j * bar, base - h, bar, h, s.css, f"{s.name} {where}: {count}"
                )
            )
    body.append(_text(group_x(0) + width / 2, base + 16, "0"))
    brk = group_x(1) - gap / 2
    body.append(_line(brk - 4, base + 4, brk + 4, base - 4, "axis"))
    decades = [g for g in range(n_bins + 1) if _decade(edges[g]) is not None]
    stride = max(1, math.ceil(len(decades) / 8))  # at most ~8 labels
    for g in decades[::stride]:
        anchor = "end" if g == n_bins else "middle"  # the last at the axis' end
        body.append(_text(group_x(1) + g * width, base + 16, _edge_label(edges[g]), anchor=anchor))
    body.append(_line(x0, base, x1, base, "axis"))
    body.append(_text((x0 + x1) / 2, base + 32, x_label))
    legend_x = x1
    for s in reversed(present):
        extra = s.hist.below + s.hist.above if s.hist is not None else 0
        name = s.name + (f" ({extra} off axis)" if extra else "")
        body.append(_text(legend_x, height - 4, name, f"legend {s.css}", anchor="end"))
        legend_x -= 9 * len(name) + 16
    return _svg(height, body, label)


def margin_at_divergence_chart(m: MarginReport, *, ulps: bool = False) -> Markup:
    """Both arms' margins at t*: in logits, or in ulps of each arm's lm_head format."""
    a, b = (m.histogram_a_ulps, m.histogram_b_ulps) if ulps else (m.histogram_a, m.histogram_b)
    return log_histogram_chart(
        [Series("arm A", a, "series-logged"), Series("arm B", b, "series-replay")],
        "margin at t* in ulps of the arm's lm_head format"
        if ulps
        else "margin at t* (top-1 \u2212 top-2 logit)",
    )


def category_chart(categories: dict[str, ProportionRead], height: int | None = None) -> Markup:
    """Horizontal bars: each category's share of the ok results with its Wilson interval."""
    # The bars start where the longest label ends (a screening's `knob: value` labels are long),
    # up to LABEL_MAX_X; a label longer than that wraps, its row growing to hold it.
    longest = max((len(name) for name in categories), default=0)
    x0, x1 = min(LABEL_MAX_X, max(150, 16 + round(CHAR_W * longest))), WIDTH - 110
    fit = int((x0 - 16) / CHAR_W)
    rows = [(name, p, _wrap(name.replace("_", " "), fit)) for name, p in categories.items()]
    tops = _row_tops([lines for *_, lines in rows], 26)
    bottom = tops[-1]
    height = height or bottom + 30
    body: list[str] = []
    for i in range(5):
        x = x0 + (x1 - x0) * i / 4
        body.append(_line(x, MT - 4, x, bottom, "grid"))
        body.append(_text(x, bottom + 16, f"{25 * i}%"))
    row_h = 26
    for i, (name, p, lines) in enumerate(rows):
        y = (tops[i] + tops[i + 1] - row_h) / 2  # the bar in the middle of its row
        share = p.estimate or 0.0
        body.append(_label(x0 - 8, y + row_h / 2, lines))
        body.append(
            _rect(
                x0,
                y + 4,
                (x1 - x0) * share,
                row_h - 8,
                f"bar cat-{name}",
                f"{name}: {p.successes} of {p.n} ({share:.1%}); 95% CI [{p.low:.1%}, {p.high:.1%}]",
            )
        )
        if p.n:
            lo, hi = x0 + (x1 - x0) * p.low, x0 + (x1 - x0) * p.high
            body.append(_line(lo, y + row_h / 2, hi, y + row_h / 2, "whisker"))
            body.append(_line(lo, y + 8, lo, y + row_h - 8, "whisker"))
            body.append(_line(hi, y + 8, hi, y + row_h - 8, "whisker"))
        body.append(_text(x1 + 8, y + 16, f"{p.successes} ({share:.1%})", anchor="start"))
    return _svg(height, body, "Category shares with 95% Wilson intervals")


def lift_chart(lifts: Sequence[LiftReport]) -> Markup:
    """Each lift as a point with its 95% bootstrap interval, on one axis with a zero line."""
    shown = [x for x in lifts if x.lift is not None]
    label = "Lift of exact agreement with 95% paired-bootstrap intervals"
    if not shown:
        return _svg(60, [_text(WIDTH / 2, 34, "no paired results", "empty")], label)
    lo = min(min(x.low or 0.0 for x in shown), -0.05)
    hi = max(max(x.high or 0.0 for x in shown), 0.05)
    pad = (hi - lo) * 0.05
    lo, hi = lo - pad, hi + pad
    x0, x1 = 220, WIDTH - MR - 10
    names = [_wrap(x.label_b, int((x0 - 16) / CHAR_W)) for x in shown]
    tops = _row_tops(names, 30)
    bottom = tops[-1]
    height = bottom + 34

    def sx(v: float) -> float:
        return x0 + (x1 - x0) * (v - lo) / (hi - lo)

    body: list[str] = []
    step = next(
        (s for s in (0.01, 0.02, 0.025, 0.05, 0.1, 0.2, 0.25, 0.5) if (hi - lo) / s <= 6), 1.0
    )
    for k in range(math.ceil(lo / step), math.floor(hi / step) + 1):
        v = k * step
        body.append(_line(sx(v), MT - 4, sx(v), bottom, "grid"))
        body.append(_text(sx(v), bottom + 16, f"{v * 100:+.0f} pp" if k else "0"))
    body.append(_line(sx(0), MT - 6, sx(0), bottom + 2, "zero"))
    for i, x in enumerate(shown):
        y = (tops[i] + tops[i + 1]) / 2
        assert x.lift is not None and x.low is not None and x.high is not None
        body.append(_label(x0 - 8, y, names[i]))
        body.append(_line(sx(x.low), y, sx(x.high), y, "ci"))
        body.append(
            f'<circle cx="{_num(sx(x.lift))}" cy="{_num(y)}" r="5" class="point">'
            f"<title>{escape(x.label_b)}: lift {x.lift * 100:+.1f} pp, 95% CI "
            f"[{x.low * 100:+.1f}, {x.high * 100:+.1f}] pp; fixed {x.fixed}, broke "
            f"{x.broke}</title></circle>"
        )
    body.append(_text((x0 + x1) / 2, height - 4, "EAR lift over the baseline (percentage points)"))
    return _svg(height, body, label)


def margin_track_chart(
    replay: Sequence[float | None] | None,
    logged: Sequence[float | None] | None,
    gate_fired_steps: Sequence[int],
    t_star: int | None,
    *,
    tau: float | None = None,
    height: int = 270,
    gate_fired_steps_a: Sequence[int] = (),
    label_a: str = "logged",
    label_b: str = "replay",
) -> Markup:
    """Per-step margins of both arms on a log axis (exact zeros on a band below it), the steps
    where each arm's gate fired as ticks on top (arm B's pointing down, arm A's, where arm A
    was run here, pointing up below them), t* as a vertical line, τ dashed. The legend names
    each arm by what it is (`label_a`: "logged" only where arm A is the logged tokens)."""
    label = "Per-step top-two margin of both arms"
    # Cut to fit the legend's row (the page names the arms in full).
    names = {
        "logged": f"arm A: {label_a}"[:LEGEND_CHARS],
        "replay": f"arm B: {label_b}"[:LEGEND_CHARS],
    }
    tracks = [(name, vals) for name, vals in (("logged", logged), ("replay", replay)) if vals]
    if not tracks:
        return _svg(60, [_text(WIDTH / 2, 34, "no per-step margins stored", "empty")], label)
    n = max(len(v) for _, v in tracks)
    positive = [m for _, v in tracks for m in v if m is not None and m > 0]
    if tau:
        positive.append(tau)
    lo = math.floor(math.log10(min(positive))) if positive else -3
    hi = max(math.ceil(math.log10(max(positive))) if positive else 1, lo + 1)
    x0, x1 = ML, WIDTH - MR
    top, zero_band, base = MT + 12, height - MB - 22, height - MB - 36

    def sx(t: float) -> float:
        return x0 + (x1 - x0) * (t + 0.5) / max(n, 1)

    def sy(m: float) -> float:
        return base - (base - top) * (math.log10(m) - lo) / (hi - lo)

    body: list[str] = []
    for d in range(lo, hi + 1):
        body.append(_line(x0, sy(10.0**d), x1, sy(10.0**d), "grid"))
        body.append(_text(x0 - 6, sy(10.0**d) + 4, f"1e{d}", anchor="end"))
    body.append(_text(x0 - 6, zero_band + 4, "0", anchor="end"))
    body.append(_line(x0, zero_band, x1, zero_band, "grid"))
    if tau:
        body.append(_line(x0, sy(tau), x1, sy(tau), "tau"))
        body.append(_text(x1 - 2, sy(tau) - 4, f"τ = {tau:g}", "axis-label tau-label", "end"))
    if t_star is not None and t_star < n:
        body.append(_line(sx(t_star), top - 10, sx(t_star), zero_band + 4, "t-star-line"))
        body.append(
            _text(sx(t_star) + 4, top - 2, f"t* = {t_star}", "axis-label t-star-label", "start")
        )
    for t in gate_fired_steps:
        body.append(
            f'<path d="M{_num(sx(t) - 4)},{_num(MT - 2)} h8 l-4,7 z" class="gate gate-b">'
            f"<title>arm B's gate fired at step {int(t)}</title></path>"
        )
    for t in gate_fired_steps_a:
        body.append(
            f'<path d="M{_num(sx(t) - 4)},{_num(MT + 14)} h8 l-4,-7 z" class="gate gate-a">'
            f"<title>arm A's gate fired at step {int(t)}</title></path>"
        )
    for name, values in tracks:
        steps = [
            (t, m, zero_band if m <= 0 else sy(m)) for t, m in enumerate(values) if m is not None
        ]
        points = " ".join(f"{_num(sx(t))},{_num(y)}" for t, _, y in steps)
        body.append(f'<polyline points="{points}" class="track track-{name}"/>')
        if n <= 400:  # dots stay readable; beyond that the line alone carries the track
            body += [
                f'<circle cx="{_num(sx(t))}" cy="{_num(y)}" r="2.2" class="dot dot-{name}">'
                f"<title>{escape(names[name])} step {t}: margin {m:g}</title></circle>"
                for t, m, y in steps
            ]
    for t in sorted({0, n // 2, n - 1}):
        body.append(_text(sx(t), zero_band + 18, t))
    body.append(_text((x0 + x1) / 2, zero_band + 32, "step"))
    legend = [("logged", names["logged"]), ("replay", names["replay"]), ("gate", "gate fired")]
    body += _legend(legend, x1, height - 4)
    return _svg(height, body, label)


def null_chart(groups: Sequence[tuple[str, list[float], float | None, float | None]]) -> Markup:
    """Each group's score against its benign null: the null's 5-95% range as a bar (its median
    a tick), the threshold a line, the group's score a marker; one row per (label, null
    quantiles at 0, 0.05, ..., 1, threshold, score)."""
    row, top = 34, MT + 6
    height = top + row * max(len(groups), 1) + MB
    values = [v for _, q, t, s in groups for v in (*q, t, s) if v is not None]
    hi = max(values, default=1.0) * 1.1 or 1.0
    x0, x1 = 24 + round(18 * CHAR_W), WIDTH - MR  # room for an 18-character label

    def x(v: float) -> float:
        return x0 + (x1 - x0) * min(max(v / hi, 0.0), 1.0)

    body = [_line(x0, top, x0, height - MB, "axis")]
    for i, (label, q, threshold, score) in enumerate(groups):
        y = top + row * i + row / 2
        body.append(_text(x0 - 8, y + 4, label[:18], anchor="end"))
        if len(q) >= 20:
            lo, mid, up = q[1], q[10], q[19]
            body.append(
                _rect(x(lo), y - 7, x(up) - x(lo), 14, "bar-null", f"null 5-95%: {lo:.4g}-{up:.4g}")
            )
            body.append(_line(x(mid), y - 9, x(mid), y + 9, "tick-null"))
        if threshold is not None:
            body.append(_line(x(threshold), y - 12, x(threshold), y + 12, "threshold"))
        if score is not None:
            body.append(
                _rect(x(score) - 4, y - 4, 8, 8, "marker-score", f"{label}: score {score:.4g}")
            )
    body.append(_text(x0, height - MB + 16, "0"))
    body.append(_text(x1, height - MB + 16, f"{hi:.3g}", anchor="end"))
    body.append(_text((x0 + x1) / 2, height - 8, "score (bar: benign null 5-95%; line: threshold)"))
    return _svg(height, body, "score against the benign null, per group")
