"""The web UI in a real headless Chromium (Debian `chromium` + `chromium-driver`, driven by
selenium) against a real uvicorn server on 127.0.0.1, seeded with a real replay run: sign in,
runs -> run -> trace, the t* highlight, sign out; no console error on any page (CSP violations
included); a screenshot of the run page in test-output/run-page.png (not committed).

Needs `apt-get install -y chromium chromium-driver` (scripts/test.sh installs them).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.reports.conftest import XSS, SeededRun
from tests.ui.chromium import (  # noqa: F401  (the browser fixture)
    OUTPUT_DIR,
    browser,
    console_errors,
    follow,
    no_alert,
    serving,
)

# One database is enough for a browser: SQLite (the embedded default).
pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("worker_env"),
    pytest.mark.slow,  # a Chromium a test
]


@pytest.fixture
def live_server(client: TestClient, seeded_run: SeededRun) -> Iterator[str]:
    with serving(client) as url:
        yield url


def _full_page_screenshot(driver: WebDriver, path: Path) -> None:
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(1400, min(max(height, 1000), 12000))
    path.parent.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(path)), path


def test_auditor_browses_run_and_trace_in_chromium(
    browser: WebDriver,  # noqa: F811
    live_server: str,
    seeded_run: SeededRun,
    api_key: Any,
) -> None:
    errors: dict[str, list[dict[str, Any]]] = {}

    def visited(name: str) -> None:
        no_alert(browser)
        errors[name] = console_errors(browser)

    # Not signed in: the runs list sends us to the sign-in page.
    browser.get(f"{live_server}/ui/runs")
    assert "/ui/sign-in" in browser.current_url
    visited("sign-in")
    browser.find_element(By.ID, "api_key").send_keys(api_key("auditor"))
    runs = f"{live_server}/ui/runs"
    follow(browser, browser.find_element(By.ID, "sign-in"), lambda u: u == runs, "the runs list")
    assert browser.find_element(By.CSS_SELECTOR, "header .role").text == "auditor"
    visited("runs")

    # Runs -> run.
    run_page = f"/ui/runs/{seeded_run.run_id}"
    follow(
        browser,
        browser.find_element(By.LINK_TEXT, seeded_run.run_id),
        lambda u: u.endswith(run_page),
        "the run page",
    )
    assert seeded_run.run_id in browser.find_element(By.ID, "run-title").text
    ear_cells = browser.find_elements(By.CSS_SELECTOR, "#comparisons td.ear .estimate")
    # FP16, FP16 + C and the reproduction check the run added
    assert len(ear_cells) == 3 and all(c.text.endswith("%") for c in ear_cells)
    charts = browser.find_elements(By.CSS_SELECTOR, "svg.chart")
    assert len(charts) >= 10 and all(c.size["height"] > 20 for c in charts)
    # The <script> in the T1 label is text, not a script.
    assert XSS in browser.find_element(By.ID, "targets").text
    visited("run")
    _full_page_screenshot(browser, OUTPUT_DIR / "run-page.png")
    for section in ("statistics", "lifts", "pair", "detail-0"):
        browser.find_element(By.ID, section).screenshot(str(OUTPUT_DIR / f"run-{section}.png"))
    browser.set_window_size(1400, 1000)

    # Run -> task accuracy and back.
    follow(
        browser,
        browser.find_element(By.ID, "accuracy-page"),
        lambda u: "/accuracy" in u,
        "the accuracy page",
    )
    assert browser.find_elements(By.CSS_SELECTOR, "#tost tbody tr")
    visited("accuracy")
    browser.back()
    WebDriverWait(browser, 30).until(lambda d: d.current_url.endswith(run_page))

    # Run -> a trace C fixed -> its page, t* highlighted on both arms.
    fixed = browser.find_elements(By.CSS_SELECTOR, "#pair .flip-list.fixed li a")
    assert fixed, "the pair section lists the traces C fixed"
    trace_id = fixed[0].text
    follow(browser, fixed[0], lambda u: f"/traces/{trace_id}" in u, "the trace page")
    follow(
        browser,
        browser.find_element(By.CSS_SELECTOR, "#comparison-tabs a.tab"),
        lambda u: u.endswith("?comparison=0"),
        "comparison 0 of the trace",
    )
    marks = browser.find_elements(By.CSS_SELECTOR, "mark.t-star")
    assert len(marks) == 2
    t_star = browser.find_element(By.ID, "t-star-value").text
    assert t_star.startswith("t* = ")
    step = int(t_star.removeprefix("t* = "))
    assert all(m.get_attribute("title").startswith(f"t* = step {step}:") for m in marks)
    assert marks[0].text != marks[1].text  # the two arms chose different tokens there
    background = marks[0].value_of_css_property("background-color")
    assert background not in ("rgba(0, 0, 0, 0)", "transparent")  # styled, visibly
    assert browser.find_elements(By.CSS_SELECTOR, "#margin-track svg .t-star-line")
    assert browser.find_elements(By.CSS_SELECTOR, "#margin-track svg path.gate")
    visited("trace")
    _full_page_screenshot(browser, OUTPUT_DIR / "trace-page.png")
    for section in ("summary", "around-t-star", "margin-track", "tokens", "configurations"):
        browser.find_element(By.ID, section).screenshot(str(OUTPUT_DIR / f"trace-{section}.png"))
    browser.set_window_size(1400, 1000)

    # The trace whose prompt carries a <script>: shown as text, never run.
    browser.get(f"{live_server}/ui/runs/{seeded_run.run_id}/traces/{seeded_run.xss_trace_id}")
    assert browser.find_element(By.ID, "prompt-text").text == f"Question {XSS}"
    visited("xss-trace")

    # Sign out: back to the sign-in page, and the pages are closed again.
    follow(
        browser,
        browser.find_element(By.ID, "sign-out"),
        lambda u: "/ui/sign-in" in u,
        "the sign-in page",
    )
    browser.get(f"{live_server}/ui/runs/{seeded_run.run_id}")
    assert "/ui/sign-in" in browser.current_url
    visited("signed-out")

    assert {k: v for k, v in errors.items() if v} == {}
