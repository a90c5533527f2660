"""The trace search (`/ui/traces`) and one trace across runs (`/ui/traces/{id}`) over HTTP:
every filter, cursor paging, the replays of a trace in two runs with their outcomes and links,
escaping, project isolation and bad input. SQLite and PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from html import unescape
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.ui import trace_pages
from tests.reports.conftest import FP16, XSS, HoldingRunner, SeededRun

pytestmark = pytest.mark.usefixtures("worker_env")

_TRACE_LINK = re.compile(r'href="/ui/traces/([^"?]+)" class="trace-link"')


def _found(client: TestClient, **params: Any) -> list[str]:
    r = client.get("/ui/traces", params=params)
    assert r.status_code == 200, (params, r.text[:500])
    return _TRACE_LINK.findall(r.text)


def test_search_by_each_field(ui_client: Callable[..., TestClient], seeded_run: SeededRun) -> None:
    client = ui_client()
    ids = seeded_run.trace_ids
    newest_first = list(reversed(ids))
    assert _found(client) == newest_first  # 24 traces: one page, newest first
    assert _found(client, id=ids[3]) == [ids[3]]
    assert _found(client, id=f"  {ids[3]} ") == [ids[3]]  # blanks around a pasted id
    assert _found(client, external_id="ext-5") == [ids[5]]
    assert _found(client, external_id=f"ext-{XSS}") == [ids[0]]
    assert _found(client, tag="batch-1") == [t for i, t in enumerate(newest_first) if i % 2 == 0]
    assert _found(client, tag="=cmd") == [ids[0]]
    assert _found(client, model="fake") == newest_first
    assert _found(client, model="fake", tag="batch-0", external_id="ext-4") == [ids[4]]
    now = datetime.now(UTC)
    today, tomorrow = now.date().isoformat(), (now + timedelta(days=1)).date().isoformat()
    yesterday = (now - timedelta(days=1)).date().isoformat()
    assert _found(client, **{"from": today, "to": today}) == newest_first
    hour_ago = (now - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    assert _found(client, **{"from": hour_ago}) == newest_first  # a datetime-local value
    for nothing in (
        {"id": "tr_nope"},
        {"external_id": "ext-99"},
        {"tag": "absent"},
        {"model": "other-model"},
        {"from": tomorrow},
        {"to": yesterday},
    ):
        r = client.get("/ui/traces", params=nothing)
        assert _TRACE_LINK.findall(r.text) == [], nothing
        assert "No trace matches." in r.text, nothing


def test_search_shows_replay_counts_and_never_replayed(
    ui_client: Callable[..., TestClient],
    seeded_run: SeededRun,
    client: TestClient,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    fresh = logged_trace([7, 7, 7]) | {"external_id": "never-replayed"}
    r = client.post("/v1/traces", json=fresh, headers=headers("submitter"))
    assert r.status_code == 201, r.text
    ui = ui_client()
    page = ui.get("/ui/traces", params={"id": seeded_run.trace_ids[2]}).text
    cell = re.search(r'<td class="replays">(.*?)</td>', page, re.S)
    # The seeded run has two comparisons and the reproduction check: three results.
    assert cell is not None and cell.group(1).startswith("3 results in 1 run"), page
    page = ui.get("/ui/traces", params={"external_id": "never-replayed"}).text
    assert "never replayed" in page


def test_search_pages_by_cursor(
    ui_client: Callable[..., TestClient], seeded_run: SeededRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_pages, "TRACES_PER_PAGE", 10)
    client = ui_client()
    seen: list[str] = []
    url = "/ui/traces?tag=production"
    pages = 0
    while url:
        r = client.get(url)
        assert r.status_code == 200, r.text[:300]
        found = _TRACE_LINK.findall(r.text)
        assert len(found) == (10 if pages < 2 else 4), (pages, found)
        seen += found
        pages += 1
        older = re.search(r'href="(/ui/traces\?[^"]+)" id="older"', r.text)
        url = unescape(older.group(1)) if older else ""
        if older:
            assert "tag=production" in url  # the filters travel with the cursor
        if pages > 1:
            assert 'id="newest"' in r.text
    assert pages == 3
    assert seen == list(reversed(seeded_run.trace_ids))  # every trace once, newest first


def test_trace_page_lists_every_replay_across_runs(
    ui_client: Callable[..., TestClient],
    seeded_run: SeededRun,
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
) -> None:
    trace = seeded_run.trace_ids[0]  # the one with <script> in its texts
    body = {"trace_ids": [trace, seeded_run.trace_ids[1]], "targets": [FP16], "name": "second look"}
    r = client.post("/v1/replays", json=body, headers=headers("admin"))
    assert r.status_code == 201, r.text
    second = r.json()["id"]
    runner.run_all()
    api = client.get(f"/v1/replays/{seeded_run.run_id}/results", headers=headers("auditor"))
    mine = [i for i in api.json()["items"] if i["trace_id"] == trace]

    ui = ui_client()
    r = ui.get(f"/ui/traces/{trace}")
    assert r.status_code == 200, r.text[:500]
    page = r.text
    assert XSS not in page and "&lt;script&gt;" in page  # texts and external id escaped
    assert 'id="prompt-text"' in page and 'id="output-text"' in page
    rows = re.findall(r'<tr class="replay">(.*?)</tr>', page, re.S)
    # 2 comparisons and the check of the seeded run + 1 and its check of the named run
    assert len(rows) == 5
    # Newest first: the named run's two results, with its name and its id.
    assert all("second look" in row and second in row for row in rows[:2])
    for c in (0, 1):
        assert any(f'href="/ui/runs/{second}/traces/{trace}?comparison={c}"' in r for r in rows[:2])
    for item in mine:
        row = next(
            x
            for x in rows
            if f'/ui/runs/{seeded_run.run_id}/traces/{trace}?comparison={item["comparison"]}"' in x
        )
        outcome = re.search(r'<td class="outcome">(.*?)</td>', row, re.S)
        assert outcome is not None
        if item["exact_match"]:
            assert "exact" in outcome.group(1)
        else:
            assert f"t* = {item['first_divergence_step']}" in outcome.group(1)
            assert item["category"] in outcome.group(1)
    # Every "open" link leads to the run's own trace page.
    for href in re.findall(r'href="([^"]+)" class="open-replay"', page):
        assert ui.get(unescape(href)).status_code == 200, href


def test_trace_page_pages_its_replays(
    ui_client: Callable[..., TestClient], seeded_run: SeededRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_pages, "REPLAYS_PER_PAGE", 1)
    client = ui_client()
    trace = seeded_run.trace_ids[4]
    first = client.get(f"/ui/traces/{trace}").text
    assert first.count('<tr class="replay">') == 1
    older = re.search(r'href="([^"]+)" id="older"', first)
    assert older is not None
    pages = [first]
    while older is not None:  # one result a page, to the oldest
        pages.append(client.get(unescape(older.group(1))).text)
        assert pages[-1].count('<tr class="replay">') == 1
        older = re.search(r'href="([^"]+)" id="older"', pages[-1])
    comparisons = [
        re.search(r"\?comparison=(\d)\" class=\"open-replay\"", p).group(1)  # type: ignore[union-attr]
        for p in pages
    ]
    assert sorted(comparisons) == ["0", "1", "2"]  # FP16, FP16 + C, the reproduction check


def test_another_projects_trace_is_not_found_and_not_listed(
    ui_client: Callable[..., TestClient], seeded_run: SeededRun
) -> None:
    client = ui_client(project="beta")
    assert client.get(f"/ui/traces/{seeded_run.trace_ids[0]}").status_code == 404
    assert _found(client) == []
    assert _found(client, id=seeded_run.trace_ids[0]) == []
    assert client.get("/ui/traces/tr_unknown").status_code == 404


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"from": "yesterday"}, "from"),
        ({"to": "2026-13-01"}, "to"),
        ({"id": "x" * 201}, "id"),
        ({"cursor": "not-a-cursor"}, "cursor"),
        ({"to": "9999-12-31"}, "to"),  # a day past the calendar's last
        ({"from": "0001-01-01T00:00+01:00"}, "from"),  # before year 1 in UTC
        ({"before": str(2**63)}, "before"),  # past a BIGINT: on /ui/runs and a trace's page
    ],
)
def test_bad_search_input_is_a_4xx_naming_the_field(
    ui_client: Callable[..., TestClient], params: dict[str, str], field: str
) -> None:
    client = ui_client()
    paths = {"before": ["/ui/runs", "/ui/traces/tr_any"], "from": ["/ui/traces", "/ui/runs"]}
    for path in paths.get(field, ["/ui/traces"]) + (["/ui/runs"] if field == "to" else []):
        r = client.get(path, params=params)
        assert r.status_code == 422, (path, r.text[:300])
        assert field in r.text


def test_unstorable_search_text_is_refused(ui_client: Callable[..., TestClient]) -> None:
    r = ui_client().get("/ui/traces", params={"tag": "a\x00b"})
    assert 400 <= r.status_code < 500
