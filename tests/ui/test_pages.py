"""The web UI over HTTP (TestClient): sign-in and sessions, every page's content, escaping,
role and project isolation for every page. SQLite and PostgreSQL."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from html import unescape
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.ui import session as ui_session
from tests.reports.conftest import XSS, SeededRun
from tests.ui.conftest import SESSION_SECRET, csrf_token, sign_in

pytestmark = pytest.mark.usefixtures("worker_env")


def _pages(run: SeededRun) -> list[str]:
    """Every page of the UI that shows a project's data."""
    r, t = run.run_id, run.trace_ids[1]
    return [
        "/ui/runs",
        f"/ui/runs/{r}",
        f"/ui/runs/{r}?a=1&b=0&comparison=0&outcome=diverged",
        f"/ui/runs/{r}/flips?a=0&b=1&kind=fixed",
        f"/ui/runs/{r}/accuracy",
        f"/ui/runs/{r}/accuracy?margin=0.1",
        f"/ui/runs/{r}/traces/{t}",
        f"/ui/runs/{r}/traces/{t}?comparison=1",
        f"/ui/runs/{r}/export.csv",
        f"/ui/runs/{r}/export.jsonl",
        f"/ui/compare?run={r}&run={r}&ca=0&cb=1",
    ]


# -- sign-in and sessions --------------------------------------------------------------------


@pytest.mark.parametrize("role", ["auditor", "admin"])
def test_sign_in_sets_a_signed_httponly_lax_cookie(
    client: TestClient, api_key: Callable[..., str], role: str
) -> None:
    key = api_key(role)
    r = sign_in(client, key, next_url="/ui/runs?dtype=fp16")
    assert r.status_code == 303
    assert r.headers["location"] == "/ui/runs?dtype=fp16"
    cookie = next(
        c for c in r.headers.get_list("set-cookie") if c.startswith(ui_session.COOKIE_NAME + "=")
    )
    flags = {part.strip().lower() for part in cookie.split(";")[1:]}
    assert {"httponly", "samesite=lax", "path=/ui"} <= flags
    assert key not in cookie and key.split("_", 2)[2] not in cookie  # never the secret
    assert client.get("/ui/runs").status_code == 200


def test_a_submitter_key_cannot_browse(client: TestClient, api_key: Callable[..., str]) -> None:
    r = sign_in(client, api_key("submitter"))
    assert r.status_code == 403
    assert "cannot browse reports" in r.text
    assert ui_session.COOKIE_NAME not in client.cookies
    assert client.get("/ui/runs", follow_redirects=False).status_code == 303


@pytest.mark.parametrize("key", ["", "ra_000000000000_nope", "not a key"])
def test_a_bad_key_is_refused(client: TestClient, key: str) -> None:
    r = sign_in(client, key)
    assert r.status_code == 401
    assert 'id="sign-in-error"' in r.text
    assert ui_session.COOKIE_NAME not in client.cookies


def test_sign_in_needs_the_form_token(client: TestClient, api_key: Callable[..., str]) -> None:
    """A page of another site cannot sign a browser into an account of its choosing."""
    r = client.post(
        "/ui/sign-in",
        data={"api_key": api_key("auditor"), "form_token": "forged"},
        follow_redirects=False,
    )
    assert r.status_code == 400
    assert ui_session.COOKIE_NAME not in client.cookies


@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/ui/runs", "/docs"])
def test_next_never_leaves_the_ui(
    client: TestClient, api_key: Callable[..., str], target: str
) -> None:
    r = sign_in(client, api_key("auditor"), next_url=target)
    assert r.status_code == 303 and r.headers["location"] == "/ui/runs"


def test_pages_without_a_session_redirect_to_sign_in(
    client: TestClient, seeded_run: SeededRun
) -> None:
    client.cookies.clear()
    for page in _pages(seeded_run):
        r = client.get(page, follow_redirects=False)
        assert r.status_code == 303, page
        assert r.headers["location"].startswith("/ui/sign-in?next=%2Fui%2F"), page


def test_forged_expired_or_revoked_sessions_are_refused(
    client: TestClient, api_key: Callable[..., str], headers: Callable[..., dict[str, str]]
) -> None:
    key = api_key("auditor")
    assert sign_in(client, key).status_code == 303
    good = client.cookies[ui_session.COOKIE_NAME]
    lookup = key.split("_")[1]
    secret = SESSION_SECRET.encode()
    version, payload, signature = good.split(".")
    # A tampered signature: its first character always changes (a fixed
    # suffix would equal the real one about once in a thousand sign-ins).
    tampered = ("B" if signature[0] != "B" else "C") + signature[1:]
    forged = [
        f"{version}.{payload}.{tampered}",
        ui_session.issue(b"another-secret-of-sixteen", lookup, 3600),
        ui_session.issue(secret, lookup, 3600, now=time.time() - 7200),  # expired
        "garbage",
    ]
    for value in forged:
        client.cookies.clear()
        client.cookies.set(ui_session.COOKIE_NAME, value)
        assert client.get("/ui/runs", follow_redirects=False).status_code == 303, value
    client.cookies.clear()
    client.cookies.set(ui_session.COOKIE_NAME, good)
    assert client.get("/ui/runs").status_code == 200
    # Revoking the key ends its session at once.
    r = client.delete(f"/v1/keys/key_{lookup}", headers=headers("admin"))
    assert r.status_code in (200, 204), r.text
    assert client.get("/ui/runs", follow_redirects=False).status_code == 303


def test_sign_out_needs_the_csrf_token_and_clears_the_cookie(
    ui_client: Callable[..., TestClient],
) -> None:
    client = ui_client()
    page = client.get("/ui/runs")
    r = client.post("/ui/sign-out", data={"csrf_token": "wrong"}, follow_redirects=False)
    assert r.status_code == 400
    assert client.get("/ui/runs").status_code == 200
    r = client.post(
        "/ui/sign-out", data={"csrf_token": csrf_token(page.text)}, follow_redirects=False
    )
    assert r.status_code == 303 and r.headers["location"] == "/ui/sign-in"
    assert ui_session.COOKIE_NAME not in client.cookies
    assert client.get("/ui/runs", follow_redirects=False).status_code == 303


def test_the_secret_is_generated_once_and_kept(tmp_path: Any) -> None:
    from replay_audit.config import Settings

    path = tmp_path / "var" / "session-secret"
    s = Settings(_env_file=None, session_secret_file=path)  # type: ignore[call-arg]
    first = ui_session._read_or_create_secret(path)
    assert len(first) == 64 and path.stat().st_mode & 0o777 == 0o600
    assert ui_session._read_or_create_secret(path) == first
    assert ui_session.session_secret(s) == first


# -- pages -----------------------------------------------------------------------------------


def test_every_page_renders_with_security_headers(
    ui_client: Callable[..., TestClient], seeded_run: SeededRun
) -> None:
    client = ui_client()
    for page in _pages(seeded_run):
        r = client.get(page)
        assert r.status_code == 200, (page, r.text[:500])
        if "export" not in page:
            assert r.headers["content-type"].startswith("text/html")
            assert "default-src 'none'" in r.headers["content-security-policy"]
            assert r.headers["cache-control"] == "no-store"


def test_runs_list_links_the_run_and_filters(
    ui_client: Callable[..., TestClient], seeded_run: SeededRun
) -> None:
    client = ui_client()
    r = client.get("/ui/runs")
    assert f'href="/ui/runs/{seeded_run.run_id}"' in r.text
    assert "fake" in r.text  # the model column
    today = datetime.now(UTC).date()
    keep = [
        {"model": "fake"},
        {"dtype": "fp16"},
        {"from": today.isoformat(), "to": today.isoformat()},
        {"model": "fake", "dtype": "fp16", "from": (today - timedelta(days=1)).isoformat()},
    ]
    drop = [
        {"model": "other-model"},
        {"dtype": "fp32"},
        {"from": (today + timedelta(days=1)).isoformat()},
        {"to": (today - timedelta(days=1)).isoformat()},
    ]
    for params in keep:
        assert seeded_run.run_id in client.get("/ui/runs", params=params).text, params
    for params in drop:
        page = client.get("/ui/runs", params=params)
        assert page.status_code == 200 and seeded_run.run_id not in page.text, params
    bad = client.get("/ui/runs", params={"from": "yesterday"})
    assert bad.status_code == 422 and "YYYY-MM-DD" in bad.text


def test_runs_list_is_paginated(
    ui_client: Callable[..., TestClient],
    seeded_run: SeededRun,
    monkeypatch: pytest.MonkeyPatch,
    headers: Callable[..., dict[str, str]],
    client: TestClient,
) -> None:
    from replay_audit.ui import pages

    h = headers("admin")
    second = client.post(
        "/v1/replays",
        json={"trace_ids": seeded_run.trace_ids[:2], "targets": [{"dtype": "fp32"}]},
        headers=h,
    ).json()["id"]
    monkeypatch.setattr(pages, "RUNS_PER_PAGE", 1)
    c = ui_client()
    first = c.get("/ui/runs")
    assert second in first.text and seeded_run.run_id not in first.text
    m = re.search(r'href="(/ui/runs\?[^"]*before=\d+)" id="older"', first.text)
    assert m is not None
    older = c.get(m.group(1).replace("&amp;", "&"))
    assert seeded_run.run_id in older.text and second not in older.text


def test_run_page_shows_statistics_charts_lifts_and_exports(
    ui_client: Callable[..., TestClient],
    seeded_run: SeededRun,
    client: TestClient,
    headers: Callable[..., dict[str, str]],
) -> None:
    report = client.get(
        f"/v1/replays/{seeded_run.run_id}/report", headers=headers("auditor")
    ).json()
    html = ui_client().get(f"/ui/runs/{seeded_run.run_id}").text
    ear = report["comparisons"][0]["ear"]
    assert f"{ear['successes']}/{ear['n']}" in html
    assert f"{ear['estimate'] * 100:.1f}%" in html and f"{ear['low'] * 100:.1f}%" in html
    lift = report["lifts"][0]
    assert f"{lift['lift'] * 100:+.1f} pp" in html
    for ref in lift["fixed_traces"]:
        assert f"/ui/runs/{seeded_run.run_id}/traces/{ref['id']}?comparison=1" in html
    assert html.count('<svg class="chart"') >= 2 * 4 + 2  # 4 per comparison, lifts, pair
    assert f'href="/ui/runs/{seeded_run.run_id}/export.csv"' in html
    assert f'href="/ui/runs/{seeded_run.run_id}/export.jsonl"' in html
    assert f'href="/ui/runs/{seeded_run.run_id}/accuracy" id="accuracy-page"' in html
    # FP16, FP16 + C and the reproduction check the run added: three results a trace.
    assert html.count('class="trace-link"') == min(50, 3 * len(seeded_run.trace_ids))


def test_accuracy_page_shows_the_reports_accuracy_flips_and_tost(
    ui_client: Callable[..., TestClient],
    seeded_run: SeededRun,
    client: TestClient,
    headers: Callable[..., dict[str, str]],
) -> None:
    h = headers("auditor")
    c = ui_client()
    for margin in (0.05, 0.6):
        acc = client.get(
            f"/v1/replays/{seeded_run.run_id}/report", params={"margin": margin}, headers=h
        ).json()["accuracy"]
        html = c.get(f"/ui/runs/{seeded_run.run_id}/accuracy", params={"margin": margin}).text
        for arm in acc["arms"]:
            p = arm["accuracy"]
            assert f"{p['successes']}/{p['n']}" in html
        rows = re.findall(
            r"<tr><td>(T\d[^<]*)</td>(.*?)</tr>", html.split('id="tost"')[1], flags=re.S
        )
        assert len(rows) == len(acc["pairs"]) == 3  # FP16, FP16 + C, the reproduction check
        for (label, cells), pair in zip(rows, acc["pairs"], strict=True):
            assert unescape(label) == pair["label_treated"]
            numbers = re.findall(r'<td class="num">(\d+)</td>', cells)
            assert numbers == [str(pair["flips"][k]) for k in ("n", "gained", "lost")]
            verdict = "yes" if pair["tost"]["non_inferior"] else "no"
            assert cells.strip().endswith(f"<td>{verdict}</td>")
        assert f'value="{margin}"' in html


def test_run_page_results_filter_and_pages(
    ui_client: Callable[..., TestClient], seeded_run: SeededRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    from replay_audit.ui import pages

    c = ui_client()
    exact = c.get(f"/ui/runs/{seeded_run.run_id}", params={"comparison": 1, "outcome": "exact"})
    assert exact.text.count('class="trace-link"') == len(seeded_run.trace_ids)
    diverged = c.get(
        f"/ui/runs/{seeded_run.run_id}", params={"comparison": 0, "category": "head_reachable"}
    ).text
    n = diverged.count('class="trace-link"')
    assert 0 < n < len(seeded_run.trace_ids)
    monkeypatch.setattr(pages, "RESULTS_PER_PAGE", 5)
    seen: list[str] = []
    url = f"/ui/runs/{seeded_run.run_id}?comparison=0"
    while url:
        page = c.get(url).text
        seen += re.findall(r'class="trace-link" href="[^"]*/traces/([^"?]+)', page)
        m = re.search(r'href="\?([^"]+)" id="results-next"', page)
        url = f"/ui/runs/{seeded_run.run_id}?{m.group(1).replace('&amp;', '&')}" if m else ""
    assert sorted(seen) == sorted(seeded_run.trace_ids)


def test_trace_page_highlights_t_star_and_shows_both_arms(
    ui_client: Callable[..., TestClient],
    seeded_run: SeededRun,
    client: TestClient,
    headers: Callable[..., dict[str, str]],
) -> None:
    report = client.get(
        f"/v1/replays/{seeded_run.run_id}/report", headers=headers("auditor")
    ).json()
    trace_id = report["lifts"][0]["fixed_traces"][0]["id"]
    result = client.get(
        f"/v1/replays/{seeded_run.run_id}/results",
        params={"limit": 500},
        headers=headers("auditor"),
    ).json()["items"]
    row = next(x for x in result if x["trace_id"] == trace_id and x["comparison"] == 0)
    t_star = row["first_divergence_step"]
    html = ui_client().get(f"/ui/runs/{seeded_run.run_id}/traces/{trace_id}").text
    assert f"t* = {t_star}" in html
    replayed = row["arms"]["b"]["output_token_ids"][t_star]
    # Each token shows its piece (the worker stored them); its tooltip names its step, its id
    # and both arms' margins there.
    piece = row["arms"]["b"]["token_pieces"][t_star]
    assert re.search(
        rf'<mark class="tok t-star piece" id="t-star-b" title="t\* = step {t_star}: token '
        rf'{replayed} · margin logged [-0-9.e]+ · margin T0: [^"]* [-0-9.e]+">'
        rf"{re.escape(piece)}</mark>",
        html,
    )
    assert 'id="t-star-a"' in html
    # The steps around t* show each arm's token with its piece too.
    row_html = re.search(r'<tr class="t-star-row">(.*?)</tr>', html, re.S)
    assert row_html is not None and f'<code class="piece">{piece}</code>' in row_html.group(1)
    # arm B's gate firings on the track; arm A is the logged trace here, not run: none drawn
    assert html.count('class="gate gate-b"') == row["gate_triggers"]
    assert row["arms"]["a"]["gate_fired_steps"] is None and 'class="gate gate-a"' not in html
    assert 'class="t-star-line"' in html
    text = unescape(html)
    assert '"dtype": "fp16"' in text and '"engine": {' in text  # requested and actual
    assert "Actual environment" in html
    # The side-by-side texts are rebuilt from the pieces, t* and everything after it marked.
    shown = re.search(r'<pre class="text pieces-text" id="text-b">(.*?)</pre>', html, re.S)
    assert shown is not None
    assert unescape(re.sub(r"<[^>]+>", "", shown.group(1))) == row["arms"]["b"]["text"]
    at = re.search(
        r'<span class="text-t-star"[^>]*>([^<]*)</span><span class="text-after">', shown.group(1)
    )
    assert at is not None and unescape(at.group(1)) == piece
    exact = (
        ui_client()
        .get(f"/ui/runs/{seeded_run.run_id}/traces/{trace_id}", params={"comparison": 1})
        .text
    )
    assert "replays exactly" in exact and 'class="tok t-star"' not in exact


def test_flips_and_compare_pages_list_the_traces(
    ui_client: Callable[..., TestClient],
    seeded_run: SeededRun,
    client: TestClient,
    headers: Callable[..., dict[str, str]],
) -> None:
    lift = client.get(f"/v1/replays/{seeded_run.run_id}/report", headers=headers("auditor")).json()[
        "lifts"
    ][0]
    c = ui_client()
    fixed = c.get(f"/ui/runs/{seeded_run.run_id}/flips", params={"a": 0, "b": 1}).text
    listed = re.findall(r"/traces/([^\"?]+)\?comparison=1", fixed)
    assert sorted(listed) == sorted(x["id"] for x in lift["fixed_traces"])
    broke = c.get(
        f"/ui/runs/{seeded_run.run_id}/flips", params={"a": 1, "b": 0, "kind": "broke"}
    ).text
    assert sorted(re.findall(r"/traces/([^\"?]+)\?comparison=0", broke)) == sorted(listed)
    cmp = c.get(
        "/ui/compare",
        params=[("run", seeded_run.run_id), ("run", seeded_run.run_id), ("ca", "0"), ("cb", "1")],
    ).text
    assert f"{lift['lift'] * 100:+.1f} pp" in cmp
    one = c.get("/ui/compare", params={"run": seeded_run.run_id})
    assert one.status_code == 422 and "exactly two runs" in one.text


def test_ui_export_is_the_api_export(
    ui_client: Callable[..., TestClient],
    seeded_run: SeededRun,
    headers: Callable[..., dict[str, str]],
    client: TestClient,
) -> None:
    api = client.get(f"/v1/replays/{seeded_run.run_id}/export", headers=headers("auditor")).text
    ui = ui_client().get(f"/ui/runs/{seeded_run.run_id}/export.csv").text
    assert ui == api and ui.count("\r\n") == 1 + 3 * len(seeded_run.trace_ids)  # + the check


# -- escaping and isolation ------------------------------------------------------------------


def test_user_supplied_text_is_escaped_everywhere(
    ui_client: Callable[..., TestClient], seeded_run: SeededRun
) -> None:
    c = ui_client()
    pages = [p for p in _pages(seeded_run) if "export" not in p] + [
        f"/ui/runs/{seeded_run.run_id}/traces/{seeded_run.xss_trace_id}",
        f"/ui/runs/{seeded_run.run_id}?comparison=0&outcome=",
    ]
    seen_escaped = 0
    for page in pages:
        html = c.get(page).text
        assert "<script" not in html.lower(), page
        seen_escaped += html.count("&lt;script&gt;")
    trace = c.get(f"/ui/runs/{seeded_run.run_id}/traces/{seeded_run.xss_trace_id}").text
    assert "Question &lt;script&gt;alert(&#39;xss&#39;)&lt;/script&gt;" in trace
    assert "ext-&lt;script&gt;" in trace
    assert seen_escaped > 5  # the T1 label on every page, the trace's texts and id
    # An error page echoing user input escapes it too.
    r = c.get(f"/ui/runs/{XSS}")
    assert r.status_code == 404 and "<script" not in r.text.lower()


def test_another_projects_pages_are_404(
    ui_client: Callable[..., TestClient], seeded_run: SeededRun
) -> None:
    c = ui_client("auditor", "other")
    assert seeded_run.run_id not in c.get("/ui/runs").text
    for page in _pages(seeded_run)[1:]:
        r = c.get(page)
        assert r.status_code == 404, page
        assert r.headers["content-type"].startswith("text/html")


def test_a_trace_of_another_project_or_not_in_the_run_is_404(
    ui_client: Callable[..., TestClient],
    seeded_run: SeededRun,
    client: TestClient,
    headers: Callable[..., dict[str, str]],
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    from tests.reports.conftest import ingest

    theirs = ingest(client, headers("admin", "other"), [logged_trace([5, 5, 5])])[0]
    unreplayed = ingest(client, headers("admin"), [logged_trace([6, 6, 6])])[0]
    c = ui_client()
    for trace in (theirs, unreplayed, "tr_nope"):
        assert c.get(f"/ui/runs/{seeded_run.run_id}/traces/{trace}").status_code == 404
    assert (
        c.get(
            f"/ui/runs/{seeded_run.run_id}/traces/{seeded_run.trace_ids[0]}",
            params={"comparison": 7},
        ).status_code
        == 422
    )


def test_unknown_ui_paths_are_html_404(ui_client: Callable[..., TestClient]) -> None:
    r = ui_client().get("/ui/nothing-here")
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert ui_client().get("/ui/static/ui.css").status_code == 200


def test_session_cookie_verification_is_pure() -> None:
    secret = b"0123456789abcdef0123"
    value = ui_session.issue(secret, "abcdef012345", 60, now=1000.0)
    s = ui_session.verify(secret, value, now=1059.0)
    assert s is not None and s.lookup == "abcdef012345" and s.expires_at == 1060
    assert ui_session.verify(secret, value, now=1060.0) is None
    assert ui_session.check_csrf(secret, s, s.csrf_token(secret))
    assert not ui_session.check_csrf(secret, s, None)


@pytest.mark.parametrize(
    "query",
    [
        {"after": 2**63},
        {"after": 2**63 - 1},
        {"comparison": 2**63},
        {"comparison": 2**31},
        {"a": 2**40, "b": 2**40},
    ],
)
def test_huge_page_cursors_and_indexes_are_4xx_or_empty_never_500(
    ui_client: Callable[..., TestClient], seeded_run: SeededRun, query: dict[str, int]
) -> None:
    """A cursor or index beyond what a database column holds is refused naming it (422), or
    reads as nothing; it never reaches the database as an overflow (500)."""
    client = ui_client()
    for path in (f"/ui/runs/{seeded_run.run_id}", f"/ui/runs/{seeded_run.run_id}/flips"):
        params = {"a": 0, "b": 1, **query} if path.endswith("flips") else query
        r = client.get(path, params=params)
        assert r.status_code in (200, 404, 422), (path, params, r.status_code, r.text[:300])
        if r.status_code == 422:
            assert next(iter(query)) in r.text
