"""Layout checks of a page in the real browser at a given viewport width (issue 33): the document
is no wider than the viewport, every chart fits its card and no chart text is cut at the
chart's edge or with an ellipsis, and every data table keeps its key column (its first headed
column) in view beside part of the next one, also when scrolled to its far end. `screenshot`
saves the whole page."""

from __future__ import annotations

import base64
from pathlib import Path

from selenium.webdriver.remote.webdriver import WebDriver

_PROBLEMS = """
const vw = document.documentElement.clientWidth, out = [];
const page = document.documentElement.scrollWidth;
if (page > vw + 1) out.push(`the page is ${page} px wide in a ${vw} px viewport`);
for (const svg of document.querySelectorAll('svg.chart')) {
  const card = svg.closest('.card') || svg.parentElement;
  const s = svg.getBoundingClientRect(), c = card.getBoundingClientRect();
  const name = svg.getAttribute('aria-label');
  if (s.width > card.clientWidth + 1 || s.right > c.right + 1 || s.left < c.left - 1)
    out.push(`chart "${name}" is ${Math.round(s.width)} px wide in a ${card.clientWidth} px card`);
  for (const t of svg.querySelectorAll('text')) {
    const b = t.getBoundingClientRect(), text = t.textContent.trim();
    if (!text) continue;
    if (b.left < s.left - 1 || b.right > s.right + 1) out.push(`chart "${name}" cuts "${text}"`);
    if (text.endsWith('\u2026')) out.push(`chart "${name}" shortens "${text}"`);
  }
}
for (const table of document.querySelectorAll('table.data')) {
  if (!table.offsetParent) continue;
  const heads = [...table.querySelectorAll('thead th')];
  const k = heads.findIndex(h => h.textContent.trim());
  if (k < 0 || k + 1 >= heads.length) continue;
  let box = table;
  while (box.parentElement && box.scrollWidth <= box.clientWidth) box = box.parentElement;
  if (box === document.documentElement || box === document.body) box = table;
  const name = table.id || heads[k].textContent.trim();
  const b = () => box.getBoundingClientRect();
  const key = () => heads[k].getBoundingClientRect();
  if (key().left < -1 || key().right > vw + 1) out.push(`table ${name}: key column off-screen`);
  if (heads[k + 1].getBoundingClientRect().left > Math.min(b().right, vw) - 24)
    out.push(`table ${name}: only its key column "${heads[k].textContent.trim()}" shows`);
  box.scrollLeft = box.scrollWidth;
  if (key().left < b().left - 1 || key().right < b().left + 8)
    out.push(`table ${name}: scrolled to its end, its key column is gone`);
  box.scrollLeft = 0;
}
return out;
"""


def at_width(driver: WebDriver, width: int, height: int = 900) -> None:
    """Lay pages out in a viewport exactly `width` CSS px wide (scrollbars excluded)."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )


def layout_problems(driver: WebDriver) -> list[str]:
    """What is cut, too wide or hidden on the current page (empty when nothing is)."""
    problems: list[str] = driver.execute_script(_PROBLEMS)
    return problems


def screenshot(driver: WebDriver, path: Path) -> None:
    """The whole page, not only the viewport, as a PNG at `path`."""
    size = driver.execute_script(
        "const e = document.documentElement;"
        "return [Math.max(e.scrollWidth, innerWidth), e.scrollHeight]"
    )
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1},
        },
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))
