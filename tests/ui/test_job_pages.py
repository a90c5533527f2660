"""The screening and verification pages over HTTP (issue 33), SQLite and PostgreSQL: the
verification lists each trace's worst tokens as its own item (one `<pre>` ran them together on
one 3,525 px line), the screening's τ of exact-tie flips reads as what it means."""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi.testclient import TestClient

from tests.ui.job_pages import seed_jobs


def test_the_verification_lists_each_trace_and_its_worst_tokens_apart(
    ui_client: Callable[..., TestClient], db_url: str
) -> None:
    ui = ui_client("auditor")
    _, verification = seed_jobs(db_url)
    html = ui.get(f"/ui/verifications/{verification}").text
    block = html[html.index('id="worst-tokens"') :]
    items = re.findall(r"<li><code>(tr_\d+)</code>: 120 tokens", block)
    assert items == [f"tr_{i:024d}" for i in range(12)]
    steps = re.findall(r"<li>step (\d+): logged 1234, reference 4321, deficit 3 ulps", block)
    assert steps == ["4", "17", "4", "17"]


def test_the_screening_shows_the_tau_of_exact_ties_as_just_above_zero(
    ui_client: Callable[..., TestClient], db_url: str
) -> None:
    ui = ui_client("auditor")
    screening, _ = seed_jobs(db_url)
    html = ui.get(f"/ui/screenings/{screening}").text
    table = html[html.index('id="tau-table"') :]
    assert "e-324" not in table
    assert "<td>0⁺ (exact ties)</td>" in table
