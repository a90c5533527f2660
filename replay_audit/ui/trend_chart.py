"""The audit schedule page's charts, inline SVG like the rest of `charts.py` (same helpers,
same CSS classes, every data label escaped).

The x axis labels runs by their due time (UTC): the time on one line, the date under it where it
differs from the previous label's, so that runs of one day (run now, catch-up) read apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC

from markupsafe import Markup, escape

from replay_audit.audits.schemas import TrendPoint
from replay_audit.formats import CATEGORIES
from replay_audit.ui.charts import MB, ML, MR, MT, WIDTH, _legend, _line, _num, _rect, _svg, _text


def _x(i: int, n: int) -> float:
    return ML + (WIDTH - MR - ML) * (i + 0.5) / max(n, 1)


#: The x axis's tick labels take two lines (time, then date): the plot ends this much higher.
TICK_LINES = 12


def _time_format(points: Sequence[TrendPoint]) -> str:
    """HH:MM, or HH:MM:SS when two runs fall in the same minute (run now twice)."""
    minutes = [p.due_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M") for p in points]
    return "%H:%M:%S" if len(set(minutes)) < len(minutes) else "%H:%M"


def _when(p: TrendPoint, time_format: str = "%H:%M") -> str:
    """A run's due time for tooltips: `2026-03-01 02:00 UTC`."""
    return p.due_at.astimezone(UTC).strftime(f"%Y-%m-%d {time_format} UTC")


def _time_ticks(points: Sequence[TrendPoint], y: float) -> list[str]:
    """Up to five labelled runs: the due time at `y`, the date under it when it is not the
    previous label's date (always on the first)."""
    n = len(points)
    fmt = _time_format(points)
    out, previous = [], None
    for i in sorted({0, n // 4, n // 2, (3 * n) // 4, n - 1}):
        t = points[i].due_at.astimezone(UTC)
        out.append(_text(_x(i, n), y, t.strftime(fmt), "axis-label tick-time"))
        date = t.date().isoformat()
        if date != previous:
            out.append(_text(_x(i, n), y + TICK_LINES, date, "axis-label tick-date"))
        previous = date
    return out


def _flag_tip(p: TrendPoint, time_format: str) -> str:
    """Every flag of a run, each naming its comparison and saying why it fired."""
    return f"{_when(p, time_format)}: " + "; ".join(
        f"{f.kind.replace('_', ' ')}: {f.reason}" for f in p.flags
    )


def trend_chart(points: Sequence[TrendPoint], height: int = 272) -> Markup:
    """EAR (dots, whiskers for the Wilson interval) and C lift (in the same percent units) per
    run, oldest left; runs without numbers (no traces, failed, running) leave a gap."""
    label = "EAR and C lift of each run of the schedule"
    measured = [p for p in points if p.ear is not None]
    if not measured:
        return _svg(60, [_text(WIDTH / 2, 34, "no evaluated run yet", "empty")], label)
    lifts = [p.c_lift for p in points if p.c_lift is not None and p.c_lift.lift is not None]
    lo = min([0.0, *(c.low if c.low is not None else c.lift or 0.0 for c in lifts)])
    lo = -0.1 * round(-lo * 10 + 0.5) if lo < 0 else 0.0  # down to a whole 10 points
    hi = 1.0
    n = len(points)
    fmt = _time_format(points)
    x0, x1, top, base = ML, WIDTH - MR, MT + 14, height - MB - TICK_LINES

    def sy(v: float) -> float:
        return base - (base - top) * (v - lo) / (hi - lo)

    body: list[str] = []
    # Grid lines at whole quarters; a negative floor (a lift below zero) gets its own label.
    grid = [k / 4 for k in range(math.ceil(lo * 4), 5)]
    for v in grid if lo == grid[0] else [lo, *grid]:
        body.append(_line(x0, sy(v), x1, sy(v), "grid"))
        body.append(_text(x0 - 6, sy(v) + 4, f"{v * 100:.0f}%", anchor="end"))
    if lo < 0:
        body.append(_line(x0, sy(0), x1, sy(0), "zero"))

    ear_pts, lift_pts = [], []
    for i, p in enumerate(points):
        x = _x(i, n)
        if p.ear is not None:
            if p.ear_low is not None and p.ear_high is not None:
                body.append(_line(x, sy(p.ear_low), x, sy(p.ear_high), "whisker"))
            ear_pts.append(f"{_num(x)},{_num(sy(p.ear))}")
            ci = (
                f" [{p.ear_low * 100:.1f}%, {p.ear_high * 100:.1f}%]"
                if p.ear_low is not None and p.ear_high is not None
                else ""
            )
            body.append(
                f'<circle cx="{_num(x)}" cy="{_num(sy(p.ear))}" r="3.2" class="dot dot-replay">'
                f"<title>{escape(_when(p, fmt))}: EAR {p.ear * 100:.1f}%{escape(ci)} "
                f"(n={p.n_sampled})</title></circle>"
            )
        lift = None if p.c_lift is None else p.c_lift.lift
        if lift is not None:
            lift_pts.append(f"{_num(x)},{_num(sy(lift))}")
            body.append(
                f'<circle cx="{_num(x)}" cy="{_num(sy(lift))}" r="2.6" '
                f'class="dot dot-logged"><title>{escape(_when(p, fmt))}: C lift '
                f"{lift * 100:+.1f} pp</title></circle>"
            )
        if p.flags:
            body.append(
                f'<path d="M{_num(x - 5)},{_num(MT - 4)} h10 l-5,8 z" class="gate flag">'
                f"<title>{escape(_flag_tip(p, fmt))}</title></path>"
            )
    if len(ear_pts) > 1:
        body.append(f'<polyline points="{" ".join(ear_pts)}" class="track track-replay"/>')
    if len(lift_pts) > 1:
        body.append(f'<polyline points="{" ".join(lift_pts)}" class="track track-logged"/>')
    body.append(_line(x0, base, x1, base, "axis"))
    body += _time_ticks(points, base + 16)
    legend = [("replay", "EAR (95% CI)"), ("logged", "C lift"), ("gate", "flagged")]
    body += _legend(legend, x1, height - 4)
    return _svg(height, body, label)


def category_mix_chart(points: Sequence[TrendPoint], height: int = 192) -> Markup:
    """One bar per run: the share of each category among the baseline comparison's traces."""
    label = "Category mix of each run (baseline comparison)"
    if not any(sum(p.categories.values()) for p in points):
        return _svg(60, [_text(WIDTH / 2, 34, "no evaluated run yet", "empty")], label)
    n = len(points)
    fmt = _time_format(points)
    x0, x1, top, base = ML, WIDTH - MR, MT, height - MB - TICK_LINES
    width = (x1 - x0) / max(n, 1)
    body: list[str] = []
    for k in range(5):
        y = base - (base - top) * k / 4
        body.append(_line(x0, y, x1, y, "grid"))
        body.append(_text(x0 - 6, y + 4, f"{k * 25}%", anchor="end"))
    for i, p in enumerate(points):
        total = sum(p.categories.values())
        if not total:
            continue
        y = float(base)
        for cat in CATEGORIES:
            count = p.categories.get(cat, 0)
            if not count:
                continue
            h = (base - top) * count / total
            y -= h
            body.append(
                _rect(
                    x0 + i * width + 1,
                    y,
                    width - 2,
                    h,
                    f"cat-{cat}",
                    f"{_when(p, fmt)}: {cat} {count}/{total} ({100 * count / total:.1f}%)",
                )
            )
    body.append(_line(x0, base, x1, base, "axis"))
    body += _time_ticks(points, base + 16)
    x = x1
    for cat in reversed(CATEGORIES):
        body.append(_text(x, height - 4, cat, f"legend cat-{cat}", "end"))
        x -= 7 * len(cat) + 18
    return _svg(height, body, label)
