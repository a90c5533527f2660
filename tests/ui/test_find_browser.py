"""Finding traces and reading the UI on a phone, in a real headless Chromium against a real
uvicorn server seeded with replayed runs.

- search: the header's Traces link, the search form (tag), a result, the trace across runs, one
  of its replays opened on the run's trace page; no console error anywhere;
- narrow screens: every page at 420 CSS px is no wider than the viewport (document scrollWidth,
  2 px tolerance: tables scroll inside their box, charts scale), with screenshots at 420 and
  1400 px in test-output/ (`narrow-<page>.png`, `wide-<page>.png`, not committed);
- at 420 and 1280 px (issue 33), every page, sign-in, screening and verification included:
  charts fit their card with their text whole, tables keep their key column in view
  (`tests/ui/layout.py`), with whole-page screenshots in test-output/screens/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.audits.conftest import schedule_body
from tests.reports.conftest import FP16, HoldingRunner, SeededRun
from tests.ui.chromium import (  # noqa: F401  (the browser fixture)
    OUTPUT_DIR,
    browser,
    console_errors,
    follow,
    no_alert,
    serving,
)
from tests.ui.job_pages import seed_jobs
from tests.ui.layout import at_width, layout_problems, screenshot

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("worker_env"),
    pytest.mark.slow,  # a Chromium a test
]

NARROW = 420
WIDE = 1400
#: Sub-pixel rounding of the layout.
TOLERANCE_PX = 2


@pytest.fixture
def world(
    client: TestClient,
    seeded_run: SeededRun,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    db_url: str,
) -> dict[str, str]:
    """The seeded run, a second (named) run over some of its traces, an audit schedule with a
    run, a screening and a verification; the ids the pages need."""
    admin = headers("admin")
    body = {
        "trace_ids": seeded_run.trace_ids[:6],
        "targets": [FP16],
        "name": "FP16 re-check of the first six traces, week 47",
    }
    r = client.post("/v1/replays", json=body, headers=admin)
    assert r.status_code == 201, r.text
    second = r.json()["id"]
    # The audit samples traces of batch 0 only: the tests count the replays of a batch-1 trace.
    selection = {"tags": ["batch-0"], "window_hours": 24}
    r = client.post("/v1/audits/schedules", json=schedule_body(selection=selection), headers=admin)
    assert r.status_code == 201, r.text
    schedule = r.json()["id"]
    r = client.post(f"/v1/audits/schedules/{schedule}/runs", headers=admin)
    assert r.status_code in (200, 201, 202), r.text
    runner.run_all()
    screening, verification = seed_jobs(db_url)
    return {
        "run": seeded_run.run_id,
        "second": second,
        "trace": seeded_run.trace_ids[1],
        "schedule": schedule,
        "screening": screening,
        "verification": verification,
    }


@pytest.fixture
def live_server(client: TestClient, world: dict[str, str]) -> Iterator[str]:
    with serving(client) as url:
        yield url


def _sign_in(browser: WebDriver, server: str, key: str) -> None:  # noqa: F811
    browser.get(f"{server}/ui/sign-in")
    browser.find_element(By.ID, "api_key").send_keys(key)
    runs = f"{server}/ui/runs"
    follow(browser, browser.find_element(By.ID, "sign-in"), lambda u: u == runs, "the runs list")


def test_find_a_trace_and_its_replays_in_chromium(
    browser: WebDriver,  # noqa: F811
    live_server: str,
    world: dict[str, str],
    seeded_run: SeededRun,
    api_key: Any,
) -> None:
    errors: dict[str, list[dict[str, Any]]] = {}

    def visited(name: str) -> None:
        no_alert(browser)
        errors[name] = console_errors(browser)

    _sign_in(browser, live_server, api_key("auditor"))
    # The runs list shows the second run by its name, its id beside it.
    named = browser.find_element(By.LINK_TEXT, "FP16 re-check of the first six traces, week 47")
    assert named.get_attribute("href").endswith(f"/ui/runs/{world['second']}")
    follow(
        browser,
        browser.find_element(By.ID, "nav-traces"),
        lambda u: u.endswith("/ui/traces"),
        "the trace search",
    )
    assert len(browser.find_elements(By.CSS_SELECTOR, "#traces a.trace-link")) == 24
    visited("traces")

    # Search by tag and external id: the one trace both match.
    form = browser.find_element(By.ID, "trace-search")
    form.find_element(By.NAME, "tag").send_keys("batch-1")
    form.find_element(By.NAME, "external_id").send_keys("ext-3")
    follow(
        browser,
        browser.find_element(By.ID, "search"),
        lambda u: "tag=batch-1" in u and "external_id=ext-3" in u,
        "the search's results",
    )
    links = browser.find_elements(By.CSS_SELECTOR, "#traces a.trace-link")
    assert [a.text for a in links] == [seeded_run.trace_ids[3]]
    # The seeded run's FP16, FP16 + C and check; the re-check's FP16 and check.
    assert "5 results in 2 runs" in browser.find_element(By.CSS_SELECTOR, "#traces td.replays").text
    visited("search")

    # The trace across runs: both runs' replays, the named one first.
    trace = seeded_run.trace_ids[3]
    follow(browser, links[0], lambda u: u.endswith(f"/ui/traces/{trace}"), "the trace page")
    assert trace in browser.find_element(By.ID, "trace-title").text
    rows = browser.find_elements(By.CSS_SELECTOR, "#replay-table tr.replay")
    assert len(rows) == 5
    assert all("week 47" in r.text and world["second"] in r.text for r in rows[:2])
    assert {r.find_element(By.CSS_SELECTOR, "td.outcome").text.split()[0] for r in rows} <= {
        "exact",
        "t*",
        "failed",
    }
    visited("trace-history")

    # One replay opened on its run's trace page.
    opener = rows[2].find_element(By.CSS_SELECTOR, "a.open-replay")
    target = opener.get_attribute("href")
    follow(browser, opener, lambda u: u == target, "the run's trace page")
    assert f"/ui/runs/{world['run']}/traces/{trace}?comparison=" in browser.current_url
    assert browser.find_element(By.ID, "comparison-tabs")
    visited("run-trace")

    assert {k: v for k, v in errors.items() if v} == {}


def _pages(world: dict[str, str]) -> dict[str, str]:
    r, t, s, second = world["run"], world["trace"], world["schedule"], world["second"]
    return {
        "runs": "/ui/runs",
        "run": f"/ui/runs/{r}",
        "trace": f"/ui/runs/{r}/traces/{t}",
        "traces": "/ui/traces",
        "trace-history": f"/ui/traces/{t}",
        "compare": f"/ui/compare?run={r}&run={second}&ca=0&cb=0",
        "accuracy": f"/ui/runs/{r}/accuracy",
        "flips": f"/ui/runs/{r}/flips?a=0&b=1&kind=fixed",
        "schedules": "/ui/schedules",
        "schedule": f"/ui/schedules/{s}",
        "screening": f"/ui/screenings/{world['screening']}",
        "verification": f"/ui/verifications/{world['verification']}",
    }


def _at_width(browser: WebDriver, width: int, height: int = 900) -> None:  # noqa: F811
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )


def _document_width(browser: WebDriver) -> int:  # noqa: F811
    return int(
        browser.execute_script(
            "return Math.max(document.documentElement.scrollWidth, document.body.scrollWidth)"
        )
    )


def _screenshot(browser: WebDriver, width: int, name: str) -> None:  # noqa: F811
    height = int(browser.execute_script("return document.documentElement.scrollHeight"))
    _at_width(browser, width, min(max(height, 600), 8000))
    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(OUTPUT_DIR / name)), name


def test_every_page_fits_a_420px_screen(
    browser: WebDriver,  # noqa: F811
    live_server: str,
    world: dict[str, str],
    api_key: Any,
) -> None:
    _sign_in(browser, live_server, api_key("auditor"))
    widths: dict[str, int] = {}
    for name, path in _pages(world).items():
        _at_width(browser, NARROW)
        browser.get(live_server + path)
        assert browser.execute_script("return window.innerWidth") == NARROW
        assert "Sign in" not in browser.title, name
        widths[name] = _document_width(browser)
        assert console_errors(browser) == [], name
        _screenshot(browser, NARROW, f"narrow-{name}.png")
        _at_width(browser, WIDE)
        browser.get(live_server + path)
        _screenshot(browser, WIDE, f"wide-{name}.png")
    too_wide = {k: v for k, v in widths.items() if v > NARROW + TOLERANCE_PX}
    assert too_wide == {}, f"pages wider than {NARROW} px: {too_wide} (all: {widths})"


@pytest.mark.parametrize("width", [NARROW, 1280])
def test_every_page_keeps_its_charts_and_key_columns_whole(
    browser: WebDriver,  # noqa: F811
    live_server: str,
    world: dict[str, str],
    api_key: Any,
    width: int,
) -> None:
    """At 420 px charts drew 640 px wide in a 383 px card, tables showed their first column
    only, the verification page was 3,525 px wide; at 1280 px sweep labels ended in '…'."""
    at_width(browser, width)
    problems: dict[str, list[str]] = {}

    def check(name: str) -> None:
        assert "error" not in browser.title.lower(), (name, browser.title)
        screenshot(browser, OUTPUT_DIR / "screens" / f"{name}-{width}.png")
        problems[name] = layout_problems(browser)

    browser.get(f"{live_server}/ui/sign-in")
    check("sign-in")
    _sign_in(browser, live_server, api_key("auditor"))
    for name, path in _pages(world).items():
        browser.get(live_server + path)
        check(name)
    bad = [f"{name}: {p}" for name, found in problems.items() for p in found]
    assert not bad, "\n".join(bad)
