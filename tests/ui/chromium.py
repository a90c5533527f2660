"""Browser support shared by the Chromium tests: a uvicorn server for the test's app on a free
port, the headless Chromium driver, and `follow`, which clicks a link or button and waits for the
navigation it starts.

A click that submits a form or follows a link may return before the browser has left the page; on
a loaded 2-core machine asserting `current_url` right after the click read the old page's URL (CI
failure of 2026-11-22, the sign-in redirect). `follow` waits for the URL the test expects and, if
it never comes, says where the browser is and what the page shows.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = "/usr/bin/chromium"
OUTPUT_DIR = Path(__file__).resolve().parents[2] / "test-output"
NAVIGATION_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(client: TestClient) -> Iterator[str]:
    """uvicorn serving the test client's app on a free port of 127.0.0.1, in a thread."""
    app = client.app
    assert isinstance(app, FastAPI)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


#: Chromium flags of a test browser that can reach nothing but 127.0.0.1: every other host name
#: fails to resolve, so a page that loads anything from a CDN shows it as a console error.
OFFLINE_FLAGS = ("--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",)


@contextmanager
def chromium(*extra_flags: str, performance_log: bool = False) -> Iterator[WebDriver]:
    """A headless Chromium driver (1400 x 1000) with `extra_flags`; `performance_log` records
    the network events (`driver.get_log("performance")`, see `requested`)."""
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
        *extra_flags,
    ):
        options.add_argument(flag)
    prefs = {"browser": "ALL"} | ({"performance": "ALL"} if performance_log else {})
    options.set_capability("goog:loggingPrefs", prefs)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    # Element lookups wait up to 10 s for the element (a page still loading); navigations are
    # awaited explicitly by `follow`.
    driver.implicitly_wait(10)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    with chromium() as driver:
        yield driver


@dataclass(frozen=True)
class Requested:
    url: str
    #: Why the browser blocked it before sending ("csp", ...), None when it went out.
    blocked: str | None


def requested(driver: WebDriver) -> list[Requested]:
    """Every request a page of the browser made since the last call (needs `performance_log`),
    with the reason the browser blocked it, if it did. The browser's own pages (`chrome://`,
    its new tab page at start) are left out."""
    urls: dict[str, str] = {}
    blocked: dict[str, str] = {}
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message.get("params", {})
        if message.get("method") == "Network.requestWillBeSent":
            urls[params["requestId"]] = str(params["request"]["url"])
        elif message.get("method") == "Network.loadingFailed" and params.get("blockedReason"):
            blocked[params["requestId"]] = str(params["blockedReason"])
    return [
        Requested(url, blocked.get(request_id))
        for request_id, url in urls.items()
        if not url.startswith("chrome://")
    ]


def follow(
    driver: WebDriver, element: WebElement, arrives: Callable[[str], bool], what: str
) -> None:
    """Click `element` and wait until the browser's URL satisfies `arrives` and the new page has
    loaded; fail naming `what` was expected, the URL reached and the page's first lines."""
    element.click()
    try:
        WebDriverWait(driver, NAVIGATION_TIMEOUT_S, poll_frequency=0.05).until(
            lambda d: (
                arrives(d.current_url)
                and d.execute_script("return document.readyState") == "complete"
            )
        )
    except TimeoutException:
        body = driver.find_element(By.TAG_NAME, "body").text[:400]
        raise AssertionError(
            f"expected {what}, the browser is at {driver.current_url}; the page reads: {body!r}"
        ) from None


def console_errors(driver: WebDriver) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def no_alert(driver: WebDriver) -> None:
    try:
        alert = driver.switch_to.alert
    except NoAlertPresentException:
        return
    text = alert.text
    alert.dismiss()
    raise AssertionError(f"a script ran: alert {text!r}")
