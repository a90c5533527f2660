"""`replay-audit traces export` and `replay` of what the API stores: traces ingested over HTTP,
exported, replayed on the bundled model; a `GET /v1/traces/{id}` answer replayed as it is;
the export posted again is the same traces (content hash), on both databases."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from replay_audit.cli import app

runner = CliRunner()
TINY = Path(__file__).parents[2] / "replay_audit" / "assets" / "tiny-llama"


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """Three traces of the bundled model, two tagged `keep`."""
    d = tmp_path_factory.mktemp("export")
    prompts = d / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": f"prompt {i}: "}) + "\n" for i in range(3))
    )
    out = d / "traces.jsonl"
    r = runner.invoke(
        app,
        ["generate", "--model", str(TINY), "--prompts", str(prompts), "--out", str(out),
         "--dtype", "bf16", "--max-new-tokens", "8", "--device", "cpu", "--threads", "1",
         "--top-k", "3"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    traces = [json.loads(x) for x in out.read_text().splitlines()]
    for t in traces[:2]:
        t["tags"] = ["keep"]
    return traces


def _replay(traces: Path, out: Path) -> None:
    r = runner.invoke(
        app,
        ["replay", str(traces), "--model", str(TINY), "--dtype", "bf16", "--out", str(out),
         "--device", "cpu", "--threads", "1", "--no-reproduce"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines and all(x["status"] == "ok" and x["exact_match"] for x in lines), lines


def test_export_replays_and_reimports(
    generated: list[dict[str, object]],
    client: TestClient,
    headers: Callable[..., dict[str, str]],
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = headers()
    r = client.post("/v1/traces:batch", json={"traces": generated}, headers=h)
    assert r.status_code in (200, 201, 207), r.text
    ids = [x["id"] for x in r.json()["results"]]
    assert all(ids)

    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", db_url)
    out = tmp_path / "export.jsonl"
    r2 = runner.invoke(app, ["traces", "export", "--project", "acme", "--out", str(out),
                             "--tag", "keep"])  # fmt: skip
    assert r2.exit_code == 0, r2.output
    assert "wrote 2 traces" in r2.output
    exported = [json.loads(x) for x in out.read_text().splitlines()]
    assert [t["external_id"] for t in exported] == [t["external_id"] for t in generated[:2]]
    assert not {"id", "project", "created_at", "config_id"} & set(exported[0])
    _replay(out, tmp_path / "results.jsonl")

    # --id and --limit select too.
    r3 = runner.invoke(app, ["traces", "export", "--project", "acme", "--out", str(out),
                             "--id", ids[2], "--id", ids[0], "--limit", "1"])  # fmt: skip
    assert r3.exit_code == 0, r3.output
    assert [json.loads(x)["external_id"] for x in out.read_text().splitlines()] == [
        generated[0]["external_id"]
    ]

    # Posted again, the export is the same traces: nothing new.
    again = client.post("/v1/traces:batch", json={"traces": exported}, headers=h)
    assert [x["id"] for x in again.json()["results"]] == ids[:2]
    assert all(x["created"] is False for x in again.json()["results"])


def test_replay_takes_the_api_read_shape(
    generated: list[dict[str, object]],
    client: TestClient,
    headers: Callable[..., dict[str, str]],
    tmp_path: Path,
) -> None:
    h = headers()
    r = client.post("/v1/traces", json=generated[2], headers=h)
    assert r.status_code in (200, 201), r.text
    read = client.get(f"/v1/traces/{r.json()['id']}", headers=h).json()
    assert {"id", "created_at", "project"} <= set(read)
    traces = tmp_path / "read.jsonl"
    traces.write_text(json.dumps(read) + "\n")
    _replay(traces, tmp_path / "results.jsonl")


def test_export_names_a_bad_filter_and_project(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", db_url)
    out = str(tmp_path / "x.jsonl")
    r = runner.invoke(app, ["traces", "export", "--project", "nope", "--out", out])
    assert r.exit_code == 2 and "no project 'nope'" in r.output
    r = runner.invoke(app, ["traces", "export", "--project", "acme", "--out", out,
                            "--filter", '{"dtype": "fp64"}'])  # fmt: skip
    assert r.exit_code == 2 and "--filter: dtype" in r.output
