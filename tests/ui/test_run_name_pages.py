"""Run names in the web UI (lists and titles show the name, escaped, with the id beside it) and
the compare page's baseline (said, and swapped by a link). SQLite and PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Callable
from html import unescape
from typing import Any

from fastapi.testclient import TestClient

from tests.replays.conftest import HoldingRunner, ingest
from tests.reports.conftest import (
    FP16_C,
    SeededRun,
    runner,  # noqa: F401  (fixture)
)


def test_ui_lists_and_titles_show_the_name_with_the_id(
    client: TestClient,
    runner: HoldingRunner,  # noqa: F811
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
    ui_client: Callable[..., TestClient],
) -> None:
    name = "nightly <b>check</b>"
    ids = ingest(client, headers("admin"), [logged_trace([1, 2, 3])])
    body = {"trace_ids": ids, "targets": [{"dtype": "fp16"}], "name": name}
    run_id = client.post("/v1/replays", json=body, headers=headers("admin")).json()["id"]
    ui = ui_client()
    runs = ui.get("/ui/runs").text
    assert "nightly &lt;b&gt;check&lt;/b&gt;" in runs and name not in runs  # escaped
    assert f'<code class="small run-id">{run_id}</code>' in runs  # the id stays visible
    assert run_id in ui.get("/ui/runs", params={"name": "CHECK"}).text
    assert run_id not in ui.get("/ui/runs", params={"name": "weekly"}).text
    page = ui.get(f"/ui/runs/{run_id}").text
    assert "<title>nightly &lt;b&gt;check&lt;/b&gt; · replay-audit</title>" in page
    assert f'<code class="run-id">{run_id}</code>' in page


def test_compare_says_which_run_is_the_baseline_and_swaps(
    ui_client: Callable[..., TestClient],
    seeded_run: SeededRun,
    client: TestClient,
    runner: HoldingRunner,  # noqa: F811
    headers: Callable[..., dict[str, str]],
) -> None:
    a = seeded_run.run_id
    body = {"trace_ids": seeded_run.trace_ids, "targets": [FP16_C], "name": "with C"}
    b = client.post("/v1/replays", json=body, headers=headers("admin")).json()["id"]
    runner.run_all()
    ui = ui_client()
    page = ui.get("/ui/compare", params={"run": [a, b], "ca": 0, "cb": 0}).text
    assert re.search(rf'Baseline: <strong id="baseline-run">{a}</strong>', page)
    assert 'Treated: <strong id="treated-run">with C</strong>' in page
    swap = re.search(r'href="(/ui/compare\?[^"]+)" id="swap"', page)
    assert swap is not None
    swapped_url = unescape(swap.group(1))
    assert swapped_url == f"/ui/compare?run={b}&run={a}&ca=0&cb=0"
    swapped = ui.get(swapped_url).text
    assert 'Baseline: <strong id="baseline-run">with C</strong>' in swapped
    # The same pairs seen from the other side: the lift changes sign, fixed and broke swap.
    lift, lift_swapped = _lift(page), _lift(swapped)
    assert lift == -lift_swapped and lift > 0  # C fixes divergences of plain FP16
    assert _counts(page) == tuple(reversed(_counts(swapped)))


def _lift(page: str) -> float:
    m = re.search(r'<td class="lift">([+-][\d.]+) pp', page)
    assert m is not None, page
    return float(m.group(1))


def _counts(page: str) -> tuple[int, int]:
    fixed = re.search(r"<th>Fixed</th><td>(\d+)", page)
    broke = re.search(r"<th>Broke</th><td>(\d+)", page)
    assert fixed is not None and broke is not None
    return int(fixed.group(1)), int(broke.group(1))
