"""One trace selection: the same selection gives the same traces through `GET /v1/traces`, a
replay `filter` and an audit schedule's `selection`, and neither a replay filter nor an audit
selects a non-greedy trace. On SQLite and PostgreSQL (the `db_url` fixture)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from fastapi.testclient import TestClient

from tests.audits.conftest import (
    PROMPTS,
    HoldingRunner,
    ingest,
    set_active_since,
    set_created_at,
    utc,
)
from tests.replays.conftest import all_results

Headers = Callable[..., dict[str, str]]
MakeSchedule = Callable[..., tuple[str, dict[str, str]]]

DUE = utc(2030, 1, 15, 2)
SAMPLED = {"strategy": "sample", "max_new_tokens": 12}


def _audited(client: TestClient, h: dict[str, str], sid: str) -> tuple[int, set[str]]:
    """(n_candidates, the traces sampled) of the schedule's one run."""
    [run] = client.get(f"/v1/audits/schedules/{sid}/runs", headers=h).json()["items"]
    assert run["status"] == "running", run
    replay = client.get(f"/v1/replays/{run['replay_run_id']}", headers=h).json()
    return run["n_candidates"], set(replay["request"]["trace_ids"])


def test_the_same_selection_through_listing_replay_filter_and_audit(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
    tick: Callable[..., Any],
    db_url: str,
) -> None:
    sid, h = make_schedule(
        selection={"tags": ["production"], "model_name": "fake", "dtype": "bf16"},
        sample_size=100,
    )
    set_active_since(db_url, sid, utc(2030, 1, 1))
    selected = ingest(client, h, [logged_trace(p) for p in PROMPTS[:4]])
    other_model = logged_trace(PROMPTS[4])
    other_model["model"] = {**other_model["model"], "name": "other"}
    fp16 = logged_trace(PROMPTS[5], config={"dtype": "fp16", "device": "cpu"})
    left_out = ingest(
        client,
        h,
        [
            logged_trace(PROMPTS[6], decoding=SAMPLED),
            logged_trace(PROMPTS[7], tags=["canary"]),
            other_model,
            fp16,
        ],
    )
    (too_early,) = ingest(client, h, [logged_trace(PROMPTS[8])])
    set_created_at(db_url, selected + left_out, DUE - timedelta(hours=1))
    set_created_at(db_url, [too_early], DUE - timedelta(hours=25))

    window = {
        "created_after": (DUE - timedelta(hours=24)).isoformat(),
        "created_before": DUE.isoformat(),
    }
    # The listing lists every trace unless asked for greedy ones only.
    params = {"model": "fake", "tag": "production", "dtype": "bf16", **window}
    listed = client.get("/v1/traces", params={**params, "greedy": "true"}, headers=h)
    assert listed.status_code == 200, listed.text
    assert {x["id"] for x in listed.json()["items"]} == set(selected)
    everything = client.get("/v1/traces", params=params, headers=h).json()["items"]
    assert {x["id"] for x in everything} == {*selected, left_out[0]}

    replay_filter = {"model_name": "fake", "tag": "production", "dtype": "bf16", **window}
    r = client.post(
        "/v1/replays", json={"filter": replay_filter, "targets": [{"dtype": "fp16"}]}, headers=h
    )
    assert r.status_code == 201, r.text
    runner.run_all()
    assert {x["trace_id"] for x in all_results(client, r.json()["id"], h)} == set(selected)

    assert tick(DUE + timedelta(seconds=10)).started == 1
    assert _audited(client, h, sid) == (len(selected), set(selected))


def test_an_audit_skips_non_greedy_traces(
    client: TestClient,
    runner: HoldingRunner,
    make_schedule: MakeSchedule,
    logged_trace: Callable[..., dict[str, Any]],
) -> None:
    sid, h = make_schedule(sample_size=100)
    greedy = ingest(client, h, [logged_trace(p) for p in PROMPTS[:3]])
    ingest(client, h, [logged_trace(PROMPTS[3], decoding=SAMPLED)])
    r = client.post(f"/v1/audits/schedules/{sid}/runs", headers=h)
    assert r.status_code == 201, r.text
    assert _audited(client, h, sid) == (3, set(greedy))
