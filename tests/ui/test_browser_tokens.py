"""Token pieces and the notes on the trace page, in a real headless Chromium: each token reads
as its text with a tooltip (step, id, both arms' margins), t* and everything after it are
highlighted in the side-by-side texts, a piece carrying a <script> is text, and the note on C
against the logged tokens appears only where it applies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.replays.conftest import HoldingRunner
from tests.reports.conftest import XSS, SeededRun, seed_run
from tests.ui.chromium import (  # noqa: F401  (the browser fixture)
    browser,
    console_errors,
    follow,
    no_alert,
    serving,
)

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("worker_env"),
    pytest.mark.slow,  # a Chromium a test
]

#: The logged pieces of every trace: token t reads "w<t>" except a split character and a
#: <script> (the first trace only).
SPLIT = [226, 130]


def _pieces(output: list[int], first: bool) -> list[Any]:
    pieces: list[Any] = [f" w{t}" for t in output]
    pieces[1] = SPLIT
    if first:
        pieces[2] = XSS
    return pieces


@pytest.fixture
def run_with_pieces(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> SeededRun:
    made = 0

    def with_pieces(prompt: list[int], **kw: Any) -> dict[str, Any]:
        nonlocal made
        body = logged_trace(prompt, **kw)
        body["output_token_pieces"] = _pieces(body["output_token_ids"], made == 0)
        made += 1
        return body

    return seed_run(client, runner, headers("admin"), with_pieces)


def _bg(element: Any) -> str:
    return str(element.value_of_css_property("background-color"))


def test_token_texts_tooltips_and_highlights_in_chromium(
    browser: WebDriver,  # noqa: F811
    client: TestClient,
    run_with_pieces: SeededRun,
    headers: Callable[..., dict[str, str]],
    api_key: Any,
) -> None:
    run = run_with_pieces
    items = client.get(
        f"/v1/replays/{run.run_id}/results", params={"limit": 500}, headers=headers("auditor")
    ).json()["items"]
    row = next(
        x for x in items
        if x["comparison"] == 0 and x["first_divergence_step"] is not None
        and x["trace_id"] != run.xss_trace_id
    )
    t_star = row["first_divergence_step"]
    with serving(client) as url:
        browser.get(f"{url}/ui/runs")
        browser.find_element(By.ID, "api_key").send_keys(api_key("auditor"))
        follow(
            browser, browser.find_element(By.ID, "sign-in"), lambda u: u.endswith("/ui/runs"),
            "the runs list",
        )
        browser.get(f"{url}/ui/runs/{run.run_id}/traces/{row['trace_id']}?comparison=0")

        # Each logged token reads as its piece; a split character as its escaped bytes.
        logged = browser.find_elements(By.CSS_SELECTOR, ".token-col.arm-a .tok")
        trace = client.get(f"/v1/traces/{row['trace_id']}", headers=headers("auditor")).json()
        # (Leading spaces are kept: a piece's spaces are part of it.)
        assert logged[0].text == f" w{trace['output_token_ids'][0]}"
        assert logged[1].text == "\\xe2\\x82" and "bytes" in logged[1].get_attribute("class")
        # The replayed arm's tokens read as the worker's pieces.
        replayed = browser.find_elements(By.CSS_SELECTOR, ".token-col.arm-b .tok")
        pieces_b = row["arms"]["b"]["token_pieces"]
        assert [t.text for t in replayed] == pieces_b

        # The tooltip: step, id and both arms' margins there.
        mark = browser.find_element(By.ID, "t-star-b")
        title = mark.get_attribute("title")
        token_b = row["arms"]["b"]["output_token_ids"][t_star]
        assert title.startswith(f"t* = step {t_star}: token {token_b} · margin logged ")
        assert " · margin T0: fp16 " in title
        other = replayed[0].get_attribute("title")
        assert other.startswith(f"step 0: token {row['arms']['b']['output_token_ids'][0]}")

        # t* and everything after it are highlighted in the side-by-side texts; before is not.
        text_b = browser.find_element(By.ID, "text-b")
        at = text_b.find_element(By.CSS_SELECTOR, ".text-t-star")
        after = text_b.find_element(By.CSS_SELECTOR, ".text-after")
        assert at.text.strip() == pieces_b[t_star].strip()
        assert after.text.strip() == "".join(pieces_b[t_star + 1 :]).strip()
        for element in (at, after):
            assert _bg(element) not in ("rgba(0, 0, 0, 0)", "transparent")
        assert _bg(at) != _bg(text_b) and _bg(after) != _bg(text_b)
        assert text_b.text.startswith("".join(pieces_b[:t_star]))
        # Comparison 0 has no C: no note.
        assert not browser.find_elements(By.ID, "c-against-logged-note")

        # Comparison 1 is C against the logged tokens: the note, visible.
        browser.get(f"{url}/ui/runs/{run.run_id}/traces/{row['trace_id']}?comparison=1")
        note = browser.find_element(By.ID, "c-against-logged-note")
        assert note.is_displayed() and "toward FP32, not toward the logged arm" in note.text

        # A piece carrying a <script> is text.
        browser.get(f"{url}/ui/runs/{run.run_id}/traces/{run.xss_trace_id}?comparison=0")
        no_alert(browser)
        tokens = browser.find_elements(By.CSS_SELECTOR, ".token-col.arm-a .tok")
        assert tokens[2].text == XSS
        assert XSS in browser.find_element(By.ID, "text-a").text
        assert console_errors(browser) == []
