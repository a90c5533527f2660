"""`GET /v1/replays/{id}/export`: the CSV and JSONL parse, have one row per result, and say the
same as the API's results and aggregate. SQLite and PostgreSQL."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.reports import export
from tests.reports.conftest import XSS, SeededRun, all_results

pytestmark = pytest.mark.usefixtures("worker_env")


def _csv(client: TestClient, run_id: str, headers: dict[str, str]) -> list[dict[str, str]]:
    r = client.get(f"/v1/replays/{run_id}/export", params={"format": "csv"}, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/csv")
    assert r.headers["content-disposition"] == f'attachment; filename="{run_id}.csv"'
    reader = csv.DictReader(io.StringIO(r.text, newline=""))
    assert tuple(reader.fieldnames or ()) == export.EXPORT_FIELDS
    return list(reader)


def test_csv_round_trip_matches_the_aggregate_and_the_results(
    client: TestClient, seeded_run: SeededRun, headers: Callable[..., dict[str, str]]
) -> None:
    h = headers("auditor")
    run = client.get(f"/v1/replays/{seeded_run.run_id}", headers=h).json()
    rows = _csv(client, seeded_run.run_id, h)
    # FP16, FP16 + C and the reproduction check the run added
    assert len(rows) == run["progress"]["total"] == 3 * len(seeded_run.trace_ids)
    assert len({(r["trace_id"], r["comparison"]) for r in rows}) == len(rows)
    for c in run["statistics"]["comparisons"]:
        mine = [r for r in rows if r["comparison"] == str(c["index"])]
        assert sum(r["exact_match"] == "true" for r in mine) == c["ear"]["successes"]
        assert sum(r["status"] == "ok" for r in mine) == c["ear"]["n"]
        assert dict(Counter(r["category"] for r in mine)) == {
            k: v["successes"] for k, v in c["categories"].items() if v["successes"]
        }
        assert sum(int(r["gate_triggers"]) for r in mine) == c["gate_triggers"]
        assert {r["arm_a"] for r in mine} == {"logged"} and {r["arm_b"] for r in mine} == {
            f"T{c['b']}"
        }
    # Numbers round-trip exactly.
    api = {(x["trace_id"], x["comparison"]): x for x in all_results(client, seeded_run.run_id, h)}
    for r in rows:
        x = api[(r["trace_id"], int(r["comparison"]))]
        t = x["first_divergence_step"]
        assert r["first_divergence_step"] == ("" if t is None else str(t))
        m = x["margin_at_divergence"]
        if m is not None and m["b"]["abs"] is not None:
            assert float(r["margin_replay"]) == m["b"]["abs"]
            assert float(r["margin_logged_ulps"]) == m["a"]["ulps"]
        assert r["has_reference_answer"] == "true"
    # A cell a spreadsheet would run as a formula is defused; other text is kept as is.
    xss = [r for r in rows if r["trace_id"] == seeded_run.xss_trace_id]
    assert {r["tags"] for r in xss} == {"'=cmd;production"}
    assert {r["external_id"] for r in xss} == {f"ext-{XSS}"}


def test_jsonl_has_typed_fields_and_the_whole_result(
    client: TestClient, seeded_run: SeededRun, headers: Callable[..., dict[str, str]]
) -> None:
    h = headers("auditor")
    r = client.get(f"/v1/replays/{seeded_run.run_id}/export", params={"format": "jsonl"}, headers=h)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    lines = r.text.splitlines()
    records = [json.loads(line) for line in lines]
    api = {(x["trace_id"], x["comparison"]): x for x in all_results(client, seeded_run.run_id, h)}
    assert len(records) == len(api)
    for rec in records:
        assert set(export.EXPORT_FIELDS) <= rec.keys()
        x = api[(rec["trace_id"], rec["comparison"])]
        assert rec["exact_match"] is x["exact_match"]
        # The typed result, as the results page gives it.
        assert rec["arms"] == x["arms"]
        assert rec["margin_at_divergence"] == x["margin_at_divergence"]
        assert rec["single_step"] == x["single_step"] and rec["semantic"] == x["semantic"]
        assert isinstance(rec["tags"], list)
    xss = next(rec for rec in records if rec["trace_id"] == seeded_run.xss_trace_id)
    assert xss["tags"] == ["=cmd", "production"]  # JSON carries data unchanged


def test_export_streams_in_batches(
    client: TestClient,
    seeded_run: SeededRun,
    headers: Callable[..., dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keyset batches smaller than the run give the same rows as one batch, no row twice."""
    h = headers("auditor")
    whole = _csv(client, seeded_run.run_id, h)
    monkeypatch.setattr(export, "BATCH", 7)
    batched = _csv(client, seeded_run.run_id, h)
    assert batched == whole

    chunks: list[bytes] = []
    with client.stream(
        "GET", f"/v1/replays/{seeded_run.run_id}/export", params={"format": "jsonl"}, headers=h
    ) as r:
        chunks.extend(r.iter_raw())
    assert len(b"".join(chunks).splitlines()) == len(whole)


@pytest.mark.parametrize(
    ("role", "project", "params", "status"),
    [
        ("admin", "other", {"format": "csv"}, 404),
        ("submitter", "acme", {"format": "csv"}, 403),
        ("auditor", "acme", {"format": "xml"}, 422),
    ],
)
def test_export_access_and_format(
    client: TestClient,
    seeded_run: SeededRun,
    headers: Callable[..., dict[str, str]],
    role: str,
    project: str,
    params: dict[str, Any],
    status: int,
) -> None:
    r = client.get(
        f"/v1/replays/{seeded_run.run_id}/export", params=params, headers=headers(role, project)
    )
    assert r.status_code == status, r.text


def test_export_needs_a_key(client: TestClient, seeded_run: SeededRun) -> None:
    assert client.get(f"/v1/replays/{seeded_run.run_id}/export").status_code == 401
