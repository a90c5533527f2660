"""`/docs` (Swagger UI) and `/redoc` (ReDoc) render in a real Chromium that can reach nothing
but the test server: every other host name fails to resolve (`OFFLINE_FLAGS`), every request
the page made is listed from the browser's network log, and the console stays free of errors
(CSP violations included)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.ui.chromium import (
    OFFLINE_FLAGS,
    OUTPUT_DIR,
    Requested,
    chromium,
    console_errors,
    requested,
)
from tests.ui.chromium import serving as serving_app

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.slow,  # a Chromium a test
]


@pytest.fixture
def offline_browser() -> Iterator[WebDriver]:
    with chromium(*OFFLINE_FLAGS, performance_log=True) as driver:
        yield driver


@pytest.fixture
def live_server(client: TestClient) -> Iterator[str]:
    with serving_app(client) as url:
        yield url


def _only_local(requests: list[Requested], server: str) -> list[Requested]:
    """Every request that left the browser went to the test server; the ones the browser
    blocked itself (never sent) are returned."""
    assert requests, "the network log recorded nothing"
    local = (server + "/", "data:", f"blob:{server}/")
    sent = [r for r in requests if r.blocked is None]
    foreign = [r.url for r in sent if not r.url.startswith(local)]
    assert foreign == [], f"requests beyond the server: {foreign}"
    return [r for r in requests if r.blocked is not None]


def test_docs_render_offline(
    offline_browser: WebDriver, live_server: str, client: TestClient
) -> None:
    browser = offline_browser
    # The browser really is offline: an outside host does not load.
    with pytest.raises(WebDriverException, match="ERR_NAME_NOT_RESOLVED"):
        browser.get("https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css")
    requested(browser)  # drop that attempt from the log
    browser.get_log("browser")

    browser.get(f"{live_server}/docs")
    WebDriverWait(browser, 30).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, ".opblock .opblock-summary-path")) > 10
    )
    title = browser.find_element(By.CSS_SELECTOR, ".information-container .title").text
    assert "replay-audit" in title
    paths = {
        e.get_attribute("data-path")
        for e in browser.find_elements(By.CSS_SELECTOR, ".opblock .opblock-summary-path")
    }
    operations = {p for p in client.get("/openapi.json").json()["paths"]}
    assert {"/v1/traces", "/v1/replays", "/v1/replays/{run_id}/report"} <= paths
    assert paths == operations  # every operation of the document is listed
    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(OUTPUT_DIR / "docs.png"))
    assert console_errors(browser) == []
    assert _only_local(requested(browser), live_server) == []


def test_redoc_renders_offline(offline_browser: WebDriver, live_server: str) -> None:
    browser = offline_browser
    browser.get(f"{live_server}/redoc")
    WebDriverWait(browser, 30).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "h1") and "replay-audit" in d.page_source
    )
    WebDriverWait(browser, 30).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "[data-section-id^='operation/']")) > 10
    )
    assert "replay-audit" in browser.find_element(By.CSS_SELECTOR, "h1").text
    browser.save_screenshot(str(OUTPUT_DIR / "redoc.png"))
    # ReDoc 2 always tries to show Redocly's logo from cdn.redoc.ly in its side menu (and hides
    # it when the image fails). The page's CSP blocks it before it is sent: that one violation
    # is expected, nothing else.
    logo = "https://cdn.redoc.ly/redoc/logo-mini.svg"
    errors = [
        e
        for e in console_errors(browser)
        if not (logo in e["message"] and e["source"] == "security")
    ]
    assert errors == []
    assert _only_local(requested(browser), live_server) == [Requested(logo, "csp")]
