"""The web UI in a real headless Chromium (Debian `chromium` + `chromium-driver`, driven by
selenium) against a real uvicorn server on 127.0.0.1, seeded with a real replay run: sign in,
runs -> run -> trace, the t* highlight, sign out; no console error on any page (CSP violations
included); a screenshot of the run page in test-output/run-page.png (not committed).

Needs `apt-get install -y chromium chromium-driver` (scripts/test.sh installs them).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.reports.conftest import XSS, SeededRun

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = "/usr/bin/chromium"
OUTPUT_DIR = Path(__file__).resolve().parents[2] / "test-output"

# One database is enough for a browser: SQLite (the embedded default).
pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("worker_env"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def live_server(client: TestClient, seeded_run: SeededRun) -> Iterator[str]:
    """uvicorn serving the seeded app on a free port of 127.0.0.1, in a thread."""
    app = client.app
    assert isinstance(app, FastAPI)
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    if not (Path(CHROMEDRIVER).exists() and Path(CHROMIUM).exists()):
        pytest.fail("Chromium is missing: apt-get install -y chromium chromium-driver")
    profile = tempfile.mkdtemp(prefix="ra-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    # A click that navigates may return before the next page is there; on a loaded 2-core
    # machine that raced find_element. Element lookups wait up to 10 s for it instead.
    driver.implicitly_wait(10)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _console_errors(driver: WebDriver) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def _no_alert(driver: WebDriver) -> None:
    try:
        alert = driver.switch_to.alert
    except NoAlertPresentException:
        return
    text = alert.text
    alert.dismiss()
    raise AssertionError(f"a script ran: alert {text!r}")


def _full_page_screenshot(driver: WebDriver, path: Path) -> None:
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(1400, min(max(height, 1000), 12000))
    path.parent.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(path)), path


def test_auditor_browses_run_and_trace_in_chromium(
    browser: WebDriver,
    live_server: str,
    seeded_run: SeededRun,
    api_key: Any,
) -> None:
    errors: dict[str, list[dict[str, Any]]] = {}

    def visited(name: str) -> None:
        _no_alert(browser)
        errors[name] = _console_errors(browser)

    # Not signed in: the runs list sends us to the sign-in page.
    browser.get(f"{live_server}/ui/runs")
    assert "/ui/sign-in" in browser.current_url
    visited("sign-in")
    browser.find_element(By.ID, "api_key").send_keys(api_key("auditor"))
    browser.find_element(By.ID, "sign-in").click()
    assert browser.current_url == f"{live_server}/ui/runs"
    assert browser.find_element(By.CSS_SELECTOR, "header .role").text == "auditor"
    visited("runs")

    # Runs -> run.
    browser.find_element(By.LINK_TEXT, seeded_run.run_id).click()
    assert browser.current_url.endswith(f"/ui/runs/{seeded_run.run_id}")
    assert seeded_run.run_id in browser.find_element(By.ID, "run-title").text
    ear_cells = browser.find_elements(By.CSS_SELECTOR, "#comparisons td.ear .estimate")
    assert len(ear_cells) == 2 and all(c.text.endswith("%") for c in ear_cells)
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
    browser.find_element(By.ID, "accuracy-page").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#tost tbody tr")
    visited("accuracy")
    browser.back()

    # Run -> a trace C fixed -> its page, t* highlighted on both arms.
    fixed = browser.find_elements(By.CSS_SELECTOR, "#pair .flip-list.fixed li a")
    assert fixed, "the pair section lists the traces C fixed"
    trace_id = fixed[0].text
    fixed[0].click()
    assert f"/traces/{trace_id}" in browser.current_url
    browser.find_element(By.CSS_SELECTOR, "#comparison-tabs a.tab").click()  # comparison 0
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
    browser.find_element(By.ID, "sign-out").click()
    assert "/ui/sign-in" in browser.current_url
    browser.get(f"{live_server}/ui/runs/{seeded_run.run_id}")
    assert "/ui/sign-in" in browser.current_url
    visited("signed-out")

    assert {k: v for k, v in errors.items() if v} == {}
