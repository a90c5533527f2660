"""Run names in the web UI: lists and titles show the name, escaped, with the id beside it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from tests.replays.conftest import HoldingRunner, ingest
from tests.reports.conftest import runner  # noqa: F401  (fixture)


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
    page = ui.get(f"/ui/runs/{run_id}").text
    assert "<title>nightly &lt;b&gt;check&lt;/b&gt; · replay-audit</title>" in page
    assert f'<code class="run-id">{run_id}</code>' in page
