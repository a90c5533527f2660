"""The audit pages of the web UI: over HTTP on SQLite and PostgreSQL (content, escaping,
sign-in, project isolation), and in a real headless Chromium against uvicorn (the trend chart
draws, no console error, no script from data runs)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from sqlalchemy import select

from replay_audit.audits.metrics import Flag
from replay_audit.audits.models import AuditRun, AuditSchedule
from replay_audit.audits.schemas import TrendPoint
from replay_audit.config import Settings
from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import session_scope
from replay_audit.ui.trend_chart import category_mix_chart, trend_chart
from tests.audits.conftest import PROMPTS, HoldingRunner, ingest, set_active_since, utc
from tests.ui.chromium import (  # noqa: F401  (the browser fixture)
    OUTPUT_DIR,
    browser,
    console_errors,
    follow,
    no_alert,
    serving,
)
from tests.ui.conftest import SESSION_SECRET, sign_in

XSS = "<script>alert('xss')</script>"


@pytest.fixture
def settings(make_settings: Callable[..., Settings], tmp_path: Path) -> Settings:
    return make_settings(
        session_secret=SESSION_SECRET, session_secret_file=tmp_path / "session-secret"
    )


@dataclass
class Seeded:
    schedule_id: str
    replay_run_id: str
    n_points: int
    n_with_ear: int
    n_flagged: int


def _history(i: int, ear: float, lift: float, flags: list[dict[str, Any]]) -> dict[str, Any]:
    cats = {"agreed": round(ear * 40), "head_reachable": 40 - round(ear * 40)}
    comps = [
        {"index": 0, "label": "FP16", "self": False, "ear": ear, "categories": cats},
        {
            "index": 1,
            "label": "FP16 + C",
            "self": False,
            "ear": min(1, ear + lift),
            "categories": {"agreed": 40},
        },
        {"index": 2, "label": "self", "self": True, "ear": 1.0, "categories": {"agreed": 40}},
    ]
    return {
        "comparisons": comps,
        "ear": ear,
        "ear_low": ear - 0.08,
        "ear_high": min(1.0, ear + 0.05),
        "c_lift": {"lift": lift, "low": lift - 0.05, "high": lift + 0.05, "comparison": 1},
        "trigger_rate": 0.004 * (i + 1),
        "categories": cats,
        "self_agreement": 1.0,
    }


@pytest.fixture
def seeded(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: Callable[..., tuple[str, dict[str, str]]],
    logged_trace: Callable[..., dict[str, Any]],
    tick: Callable[..., Any],
    db_url: str,
) -> Seeded:
    """A schedule whose name carries a <script>: six past nights (one empty, one flagged), one
    real run (run now, replayed by the fake engines, evaluated), and missed nights."""
    sid, h = make_schedule(
        name=f"nightly {XSS}", webhook_url="https://hooks.example.com/SECRET-T0K3N"
    )
    drop = [
        {
            "kind": "ear_drop",
            "comparison": 0,
            "label": "FP16",
            "test": {
                "test": "fisher_exact_less",
                "latest_successes": 32,
                "latest_n": 40,
                "baseline_successes": 114,
                "baseline_n": 120,
                "baseline_runs": 3,
                "p_value": 0.0021,
                "alpha": 0.01,
            },
            "drop_points": 15.0,
            "threshold_points": 5.0,
            "message": f"FP16: EAR 32/40 (80.0%) vs 114/120 (95.0%) {XSS}",
        }
    ]
    # A flag stored before flags were typed: no label, no test.
    old = [{"kind": "self_disagreement", "comparison": 2, "message": "self-replay 97.5%"}]
    nights = [
        (0.95, 0.05, []),
        (0.93, 0.07, old),
        (None, None, []),
        (0.96, 0.04, []),
        (0.80, 0.18, drop),
        (0.94, 0.06, []),
    ]
    with session_scope(db_url) as s:
        schedule = s.scalar(select(AuditSchedule).where(AuditSchedule.public_id == sid))
        assert schedule is not None
        for i, (ear, lift, flags) in enumerate(nights):
            due = utc(2026, 3, i + 1, 2)
            s.add(
                AuditRun(
                    public_id=f"ar_seed{i}",
                    schedule_id=schedule.id,
                    due_at=due,
                    trigger="scheduled",
                    status="no_traces" if ear is None else "done",
                    window_start=due - timedelta(days=1),
                    window_end=due,
                    n_sampled=0 if ear is None else 40,
                    metrics=None if ear is None else _history(i, ear, lift or 0, flags),
                    flags=flags,
                )
            )
    ingest(client, h, [logged_trace(p) for p in PROMPTS[:12]])
    run = client.post(f"/v1/audits/schedules/{sid}/runs", headers=h).json()["run"]
    runner.run_all()
    assert tick().evaluated == 1
    set_active_since(db_url, sid, utcnow() - timedelta(days=3))
    with session_scope(db_url) as s:
        real = s.scalar(select(AuditRun).where(AuditRun.public_id == run["id"]))
        assert real is not None
        flagged = sum(bool(f) for *_, f in nights) + bool(real.flags)
    return Seeded(sid, run["replay_run_id"], len(nights) + 1, len(nights), flagged)


def test_schedule_list_and_page(
    client: TestClient, seeded: Seeded, api_key: Callable[..., str]
) -> None:
    assert sign_in(client, api_key("auditor")).status_code == 303
    page = client.get("/ui/schedules")
    assert page.status_code == 200
    assert f'href="/ui/schedules/{seeded.schedule_id}"' in page.text
    assert 'href="/ui/schedules">Audits</a>' in page.text  # in the header
    assert "nightly &lt;script&gt;" in page.text and XSS not in page.text

    page = client.get(f"/ui/schedules/{seeded.schedule_id}")
    assert page.status_code == 200, page.text
    html = page.text
    assert XSS not in html and "&lt;script&gt;" in html  # the name and a flag's message
    assert "SECRET-T0K3N" not in html and "https://hooks.example.com/..." in html
    assert html.count('class="trend-row') == seeded.n_points
    assert html.count('class="trend-row flagged"') == seeded.n_flagged
    assert html.count('class="dot dot-replay"') == seeded.n_with_ear
    assert html.count('class="gate flag"') == seeded.n_flagged
    assert "no traces" in html and "ear drop" in html
    # Each flag names its comparison and says why it fired, on the page and in the chart.
    assert '<span class="flag-comparison">FP16</span>' in html
    assert "p = 0.0021 ≤ α = 0.01" in html  # noqa: RUF001
    assert re.search(r'class="flag-reason">FP16: EAR 32/40 \(80.0%\) vs 114/120', html)
    assert '<span class="flag-comparison">comparison 2</span>' in html  # the old flag
    assert re.search(r"<title>2026-03-05 02:00 UTC: ear drop: FP16: EAR 32/40", html)
    assert "one-sided Fisher exact test" in html and "α = 0.01" in html  # noqa: RUF001
    # The x axis: due times, and the date under each where it changes.
    chart = re.search(r'<figure id="trend-chart">.*?</figure>', html, re.S)
    assert chart is not None
    times = re.findall(r'class="axis-label tick-time"[^>]*>([^<]+)<', chart.group(0))
    dates = re.findall(r'class="axis-label tick-date"[^>]*>([^<]+)<', chart.group(0))
    assert times and all(re.fullmatch(r"\d\d:\d\d(:\d\d)?", t) for t in times)
    assert dates[0] == "2026-03-01" and len(set(dates)) == len(dates)
    assert f'href="/ui/runs/{seeded.replay_run_id}"' in html  # the real run's report
    missed = re.search(r'<ul id="missed-list">(.*?)</ul>', html, re.S)
    assert missed is not None and 2 <= missed.group(1).count("<li>") <= 3
    assert f"replay-audit audit catch-up --schedule {seeded.schedule_id}" in html

    # The scheduled run's report links back to its schedule.
    run_page = client.get(f"/ui/runs/{seeded.replay_run_id}").text
    assert f'href="/ui/schedules/{seeded.schedule_id}" id="schedule-link"' in run_page


def test_schedule_pages_need_a_session_and_stay_in_the_project(
    client: TestClient, seeded: Seeded, api_key: Callable[..., str]
) -> None:
    r = client.get(f"/ui/schedules/{seeded.schedule_id}", follow_redirects=False)
    assert r.status_code == 303 and "/ui/sign-in" in r.headers["location"]
    assert sign_in(client, api_key("auditor", "globex")).status_code == 303
    r = client.get(f"/ui/schedules/{seeded.schedule_id}")
    assert r.status_code == 404 and "text/html" in r.headers["content-type"]
    assert "nightly" not in r.text
    assert "No audit schedule in this project." in client.get("/ui/schedules").text
    assert client.get("/ui/schedules/as_nope").status_code == 404


@pytest.fixture
def live_server(client: TestClient, seeded: Seeded) -> Iterator[str]:
    with serving(client) as url:
        yield url


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_auditor_follows_the_trend_in_chromium(
    browser: WebDriver,  # noqa: F811
    live_server: str,
    seeded: Seeded,
    api_key: Callable[..., str],
) -> None:
    errors: dict[str, list[dict[str, Any]]] = {}

    def visited(name: str) -> None:
        no_alert(browser)
        errors[name] = console_errors(browser)

    browser.get(f"{live_server}/ui/sign-in")
    browser.find_element(By.ID, "api_key").send_keys(api_key("auditor"))
    follow(
        browser,
        browser.find_element(By.ID, "sign-in"),
        lambda u: u.endswith("/ui/runs"),
        "the runs list after signing in",
    )
    schedules = f"{live_server}/ui/schedules"
    follow(
        browser,
        browser.find_element(By.LINK_TEXT, "Audits"),
        lambda u: u == schedules,
        "the schedules list",
    )
    visited("schedules")

    schedule_page = f"/ui/schedules/{seeded.schedule_id}"
    follow(
        browser,
        browser.find_element(By.CSS_SELECTOR, "a.schedule-link"),
        lambda u: u.endswith(schedule_page),
        "the schedule page",
    )
    assert browser.find_element(By.ID, "schedule-title").text.startswith(f"nightly {XSS}")
    chart = browser.find_element(By.CSS_SELECTOR, "#trend-chart svg.chart")
    assert chart.size["height"] > 100 and chart.size["width"] > 300
    dots = browser.find_elements(By.CSS_SELECTOR, "#trend-chart circle.dot-replay")
    assert len(dots) == seeded.n_with_ear
    assert dots[0].value_of_css_property("fill") not in ("none", "rgb(0, 0, 0)")  # styled
    assert len(browser.find_elements(By.CSS_SELECTOR, "#trend-chart path.flag")) == seeded.n_flagged
    assert browser.find_elements(By.CSS_SELECTOR, "#mix-chart rect.cat-head_reachable")
    rows = browser.find_elements(By.CSS_SELECTOR, "#trend-table tr.trend-row")
    assert len(rows) == seeded.n_points
    assert any("ear drop" in r.text for r in rows)
    # The reason is on the page, not only in a tooltip.
    reasons = browser.find_elements(By.CSS_SELECTOR, "#trend-table .flag-reason")
    assert any("32/40" in r.text and r.is_displayed() for r in reasons)
    ticks = browser.find_elements(By.CSS_SELECTOR, "#trend-chart text.tick-date")
    assert len({t.text for t in ticks}) == len(ticks) > 1
    assert browser.find_elements(By.CSS_SELECTOR, "#missed-list li")
    visited("schedule")
    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    browser.find_element(By.ID, "trend").screenshot(str(OUTPUT_DIR / "schedule-trend.png"))

    # The newest run -> its report -> back to the schedule.
    run_page = f"/ui/runs/{seeded.replay_run_id}"
    follow(
        browser,
        browser.find_element(By.CSS_SELECTOR, f'#trend-table a[href$="{run_page}"]'),
        lambda u: u.endswith(run_page),
        "the newest run's page",
    )
    visited("run")
    follow(
        browser,
        browser.find_element(By.ID, "schedule-link"),
        lambda u: u.endswith(schedule_page),
        "the schedule page again",
    )
    visited("back")
    assert {k: v for k, v in errors.items() if v} == {}


def _point(i: int, due: datetime, flags: list[Flag]) -> TrendPoint:
    return TrendPoint(
        audit_run_id=f"ar_{i}",
        due_at=due,
        date=due.date().isoformat(),
        trigger="manual",
        status="done",
        replay_run_id=None,
        n_sampled=20,
        ear=0.9,
        ear_low=0.7,
        ear_high=0.97,
        c_lift=None,
        trigger_rate=None,
        categories={"agreed": 18, "head_reachable": 2},
        self_agreement=None,
        comparisons=[],
        flags=flags,
        flagged=bool(flags),
    )


def test_runs_of_one_day_read_apart_and_flags_name_their_comparison() -> None:
    """Five runs on one day (run now, catch-up): the axis shows their times, the date once;
    two in the same minute get seconds; each flag's tooltip names its comparison."""
    flag = Flag(
        kind="new_category",
        comparison=1,
        label="FP16 + C",
        category="kv_dependent",
        message="FP16 + C: first kv_dependent divergences",
    )
    old = Flag(kind="ear_drop", comparison=0, message="EAR 80% is 9 points below")
    day = [utc(2026, 3, 1, h, m) for h, m in ((0, 5), (3, 10), (9, 0), (14, 30), (21, 45))]
    points = [_point(i, t, [flag, old] if i == 2 else []) for i, t in enumerate(day)]
    svg = str(trend_chart(points))
    assert re.findall(r'tick-time"[^>]*>([^<]+)<', svg) == [
        "00:05",
        "03:10",
        "09:00",
        "14:30",
        "21:45",
    ]
    assert re.findall(r'tick-date"[^>]*>([^<]+)<', svg) == ["2026-03-01"]
    [tip] = re.findall(r'class="gate flag"><title>([^<]+)<', svg)
    assert tip == (
        "2026-03-01 09:00 UTC: new category: FP16 + C: first kv_dependent divergences; "
        "ear drop: comparison 0: EAR 80% is 9 points below"
    )
    assert "2026-03-01 14:30 UTC: EAR 90.0%" in svg  # the dots' tooltips carry the time too
    same_minute = [
        _point(0, utc(2026, 3, 1, 2, 0, 1), []),
        _point(1, utc(2026, 3, 1, 2, 0, 40), []),
    ]
    svg = str(category_mix_chart(same_minute))
    assert re.findall(r'tick-time"[^>]*>([^<]+)<', svg) == ["02:00:01", "02:00:40"]
