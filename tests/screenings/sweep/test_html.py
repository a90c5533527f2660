"""The screening's self-contained HTML page in the real browser: it renders every section and
its charts with no console error, and loads nothing from anywhere (no external asset)."""

from __future__ import annotations

import re
from pathlib import Path

from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from replay_audit.screenings.sweep.analysis import build_report
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig, build_plan
from replay_audit.screenings.sweep.runner import MemoryStore
from replay_audit.ui.screening_view import standalone_html
from tests.screenings.sweep.fake_screen import STEPS, FakeBackend, prompts
from tests.ui.chromium import OUTPUT_DIR, browser, console_errors  # noqa: F401  (the fixture)


def _html() -> str:
    plan = build_plan(
        Platform(device="cpu"),
        reference=ScreenConfig("fp32"),
        knobs=("body_dtype", "tf32", "batch_size", "weight_storage", "deterministic"),
        max_new_tokens=STEPS,
    )
    out = FakeBackend().run(plan, prompts(), MemoryStore())
    report = build_report(plan, prompts(), out, model="fake <model>", weights_sha256="ab" * 32)
    return standalone_html(report)


def test_the_page_has_no_external_asset_and_escapes_names() -> None:
    html = _html()
    assert not re.search(r'(src|href)="(https?:)?//', html)
    assert "<link" not in html and "<script" not in html
    assert "fake &lt;model&gt;" in html


def test_the_page_opens_in_chromium_without_console_errors(
    browser: WebDriver,  # noqa: F811
    tmp_path: Path,
) -> None:
    path = tmp_path / "report.html"
    path.write_text(_html(), encoding="utf-8")
    browser.get(path.as_uri())
    assert browser.find_element(By.ID, "tier").text.startswith("Tier 1")
    assert "gated C" in browser.find_element(By.ID, "action").text
    for section in ("sweep", "head-vs-body", "trigger-density", "margins", "tau-calibration"):
        assert browser.find_element(By.ID, section).is_displayed()
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.chart")) >= 5
    # At 1280 px no chart text is cut at the chart's edge (the sweep's `knob: value` labels
    # were cut at their start).
    browser.set_window_size(1280, 1000)
    clipped = browser.execute_script(
        """return [...document.querySelectorAll('svg.chart text')].filter(t => {
             const box = t.getBoundingClientRect(), svg = t.ownerSVGElement.getBoundingClientRect();
             return t.textContent.trim() && (box.left < svg.left - 1 || box.right > svg.right + 1);
           }).map(t => t.textContent)"""
    )
    assert clipped == []
    sweep = browser.find_elements(By.CSS_SELECTOR, "#sweep svg.chart text")
    assert any(": " in t.text for t in sweep)  # the sweep's labels, there to be checked
    rows = browser.find_elements(By.CSS_SELECTOR, "#knobs tr.knob-not_available")
    assert rows and "not available here" in rows[0].text
    assert console_errors(browser) == []
    OUTPUT_DIR.mkdir(exist_ok=True)
    browser.save_screenshot(str(OUTPUT_DIR / "screening-report.png"))
