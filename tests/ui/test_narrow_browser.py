"""The web UI at a phone's width (420 px) in a real headless Chromium (issue 20, a newcomer's
first hour): tables keep their columns and scroll sideways with a visible cue, instead of
squeezing a run's name to one word per line and pushing EAR and Traces off-screen; charts keep
legible text; the trace page's "Around t*" keeps every column reachable. At 1280 px nothing of
that is needed: the runs table fits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.reports.conftest import SeededRun
from tests.ui.chromium import browser, follow, serving  # noqa: F401  (the browser fixture)

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("worker_env"),
    pytest.mark.slow,  # a Chromium a test
]


@pytest.fixture
def live_server(client: TestClient, seeded_run: SeededRun) -> Iterator[str]:
    with serving(client) as url:
        yield url


def _sign_in(driver: WebDriver, url: str, key: str) -> None:
    driver.get(f"{url}/ui/runs")
    driver.find_element(By.ID, "api_key").send_keys(key)
    runs = f"{url}/ui/runs"
    follow(driver, driver.find_element(By.ID, "sign-in"), lambda u: u == runs, "the runs list")


def _scrolls_with_a_cue(driver: WebDriver, element: Any) -> None:
    """`element` is wider than its box, scrolls sideways, and draws the edge shadows."""
    width, box = driver.execute_script(
        "return [arguments[0].scrollWidth, arguments[0].clientWidth]", element
    )
    assert width > box, "the table fits: nothing to scroll at this width?"
    assert element.value_of_css_property("overflow-x") == "auto"
    assert "radial-gradient" in element.value_of_css_property("background-image")


def test_pages_at_420_px_keep_columns_readable_and_scroll_with_a_cue(
    browser: WebDriver,  # noqa: F811
    live_server: str,
    seeded_run: SeededRun,
    api_key: Any,
) -> None:
    browser.set_window_size(420, 900)
    try:
        _sign_in(browser, live_server, api_key("auditor"))
        table = browser.find_element(By.ID, "runs")
        _scrolls_with_a_cue(browser, table)
        # A run's name on one line (it was one word per line), every header on one line.
        link = browser.find_element(By.CSS_SELECTOR, "#runs a.run-link")
        line = float(link.value_of_css_property("line-height").removesuffix("px"))
        assert link.size["height"] <= 1.5 * line, link.size
        for th in table.find_elements(By.CSS_SELECTOR, "thead th"):
            assert th.size["height"] <= 40, (th.text, th.size)
        # EAR, the last column, is reached by scrolling the table, not the page.
        browser.execute_script("arguments[0].scrollLeft = arguments[0].scrollWidth", table)
        ear = table.find_elements(By.CSS_SELECTOR, "thead th")[-1]
        assert ear.text.startswith("EAR")
        right = browser.execute_script("return arguments[0].getBoundingClientRect().right", ear)
        assert right <= browser.execute_script("return window.innerWidth")

        # The run page's charts keep their text legible (it scaled down to about 5 px).
        browser.get(f"{live_server}/ui/runs/{seeded_run.run_id}")
        texts = browser.find_elements(By.CSS_SELECTOR, "svg.chart text")
        assert texts
        heights = [t.size["height"] for t in texts[:20] if t.text.strip()]
        assert heights and min(heights) >= 9, heights

        # A trace that diverged (one C fixed): its "Around t*" keeps every column reachable.
        fixed = browser.find_elements(By.CSS_SELECTOR, "#pair .flip-list.fixed li a")
        assert fixed, "the pair section lists the traces C fixed"
        trace = fixed[0].text
        browser.get(f"{live_server}/ui/runs/{seeded_run.run_id}/traces/{trace}?comparison=0")
        steps = browser.find_element(By.CSS_SELECTOR, "#around-t-star table.steps")
        _scrolls_with_a_cue(browser, steps)
        headers = steps.find_elements(By.CSS_SELECTOR, "thead th")
        assert len(headers) == 6 and all(h.size["height"] <= 40 for h in headers)
    finally:
        browser.set_window_size(1400, 1000)


def test_the_runs_table_fits_at_1280_px(
    browser: WebDriver,  # noqa: F811
    live_server: str,
    api_key: Any,
) -> None:
    browser.set_window_size(1280, 900)
    try:
        _sign_in(browser, live_server, api_key("auditor"))
        table = browser.find_element(By.ID, "runs")
        width, box = browser.execute_script(
            "return [arguments[0].scrollWidth, arguments[0].clientWidth]", table
        )
        assert width <= box
    finally:
        browser.set_window_size(1400, 1000)
