"""The ingest contract over HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from replay_audit.config import MAX_BATCH_TRACES
from replay_audit.db.unit_of_work import session_scope
from replay_audit.traces import repository
from replay_audit.traces.models import NumericalConfigRow, Trace, TraceTag
from replay_audit.traces.repository import OneTraceInsert
from tests.factories import make_batch, make_config, make_trace

Headers = Callable[..., dict[str, str]]


def count_rows(db_url: str, model: type) -> int:
    with session_scope(db_url) as session:
        return int(session.execute(select(func.count()).select_from(model)).scalar_one())


def test_post_then_read_back_every_field_exactly(client: TestClient, headers: Headers) -> None:
    writer, reader = headers("submitter"), headers("auditor")
    # Ids across the whole int32 range and logits that need all of float32's bits.
    trace = make_trace(
        n_prompt=40,
        n_output=30,
        vocab=2**31 - 1,
        prompt_token_ids=[0, 1, 2**31 - 2, 2**24 + 1, 123456789, *range(35)],
        external_id="req-0001",
        tags=["prod", "eu-west"],
        config=make_config(extras={"quant": "none", "seed": 3, "ratio": 0.1}),
    )
    logits = trace["top_k"]["logits"]
    logits[0] = [float(np.float32(16.0) + np.float32(0.125)), 1.0e-30]

    answer = client.post("/v1/traces", json=trace, headers=writer)
    assert answer.status_code == 201, answer.text
    body = answer.json()
    assert body["created"] is True and body["id"].startswith("tr_")

    read = client.get(f"/v1/traces/{body['id']}", headers=reader)
    assert read.status_code == 200
    got = read.json()
    for field in ("prompt_token_ids", "output_token_ids"):
        assert got[field] == trace[field]
    assert got["top_k"]["ids"] == trace["top_k"]["ids"]
    sent32 = np.array(trace["top_k"]["logits"], dtype=np.float32)
    got64 = np.array(got["top_k"]["logits"], dtype=np.float64)
    # Returned values are the float32 values exactly (a float64 holding a float32).
    assert np.array_equal(got64, sent32.astype(np.float64))
    assert np.array_equal(got64.astype(np.float32).astype(np.float64), got64)
    for field in (
        "model",
        "decoding",
        "tags",
        "external_id",
        "reference_answer",
        "prompt_text",
        "output_text",
    ):
        assert got[field] == trace[field], field
    assert {k: got["config"][k] for k in trace["config"]} == trace["config"]
    assert got["id"] == body["id"] and got["project"] == "acme"
    assert got["config_id"].startswith("cfg_") and len(got["content_sha256"]) == 64


def test_logits_are_stored_as_float32(client: TestClient, headers: Headers) -> None:
    trace = make_trace(n_output=1, top_k={"ids": [[5, 6]], "logits": [[0.1, 0.05]]})
    trace["output_token_ids"] = [5]
    created = client.post("/v1/traces", json=trace, headers=headers("admin")).json()
    got = client.get(f"/v1/traces/{created['id']}", headers=headers("admin")).json()
    assert got["top_k"]["logits"] == [[float(np.float32(0.1)), float(np.float32(0.05))]]


def test_trace_without_top_k_round_trips(client: TestClient, headers: Headers) -> None:
    trace = make_trace(top_k=None)
    created = client.post("/v1/traces", json=trace, headers=headers("admin")).json()
    got = client.get(f"/v1/traces/{created['id']}", headers=headers("admin")).json()
    assert got["top_k"] is None and got["output_token_ids"] == trace["output_token_ids"]


def test_token_arrays_are_stored_packed_int32(
    client: TestClient, headers: Headers, db_url: str
) -> None:
    trace = make_trace(n_prompt=9, n_output=4)
    client.post("/v1/traces", json=trace, headers=headers("admin"))
    with session_scope(db_url) as session:
        row = session.execute(select(Trace)).scalar_one()
        assert row.prompt_token_ids.dtype == np.int32
        assert row.prompt_token_ids.tolist() == trace["prompt_token_ids"]
        # 4 bytes a token in the column itself, not a JSON list.
        stored_bytes = session.execute(select(func.length(Trace.prompt_token_ids))).scalar_one()
        assert stored_bytes == 9 * 4
        assert row.top_k == 2 and row.top_k_logits is not None
        assert row.top_k_logits.dtype == np.float32 and row.top_k_logits.size == 8


def test_same_content_twice_returns_existing_id_with_200(
    client: TestClient, headers: Headers, db_url: str
) -> None:
    h = headers("submitter")
    first = client.post("/v1/traces", json=make_trace(seed=11), headers=h)
    again = client.post("/v1/traces", json=make_trace(seed=11), headers=h)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == {"status": 200, "id": first.json()["id"], "created": False}
    assert count_rows(db_url, Trace) == 1


def test_same_content_in_another_project_is_a_new_trace(
    client: TestClient, headers: Headers, db_url: str
) -> None:
    a = client.post("/v1/traces", json=make_trace(seed=5), headers=headers("submitter", "a"))
    b = client.post("/v1/traces", json=make_trace(seed=5), headers=headers("submitter", "b"))
    assert a.status_code == b.status_code == 201 and a.json()["id"] != b.json()["id"]
    # ...but the numerical configuration is stored once and shared.
    assert count_rows(db_url, NumericalConfigRow) == 1


def test_configurations_are_stored_once_per_distinct_content(
    client: TestClient, headers: Headers, db_url: str
) -> None:
    h = headers("admin")
    ids = [client.post("/v1/traces", json=make_trace(), headers=h).json()["id"] for _ in range(3)]
    fp16 = client.post(
        "/v1/traces", json=make_trace(config={"dtype": "fp16", "lm_head_dtype": None}), headers=h
    ).json()["id"]
    assert count_rows(db_url, Trace) == 4 and count_rows(db_url, NumericalConfigRow) == 2
    config_ids = {client.get(f"/v1/traces/{i}", headers=h).json()["config_id"] for i in ids}
    assert len(config_ids) == 1
    assert client.get(f"/v1/traces/{fp16}", headers=h).json()["config_id"] not in config_ids


def test_external_id_repeated_with_same_content_is_idempotent(
    client: TestClient, headers: Headers
) -> None:
    h = headers("submitter")
    trace = make_trace(seed=3, external_id="job-7")
    first = client.post("/v1/traces", json=trace, headers=h)
    again = client.post("/v1/traces", json=trace, headers=h)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]


def test_external_id_reused_with_different_content_is_409(
    client: TestClient, headers: Headers, db_url: str
) -> None:
    h = headers("submitter")
    first = client.post("/v1/traces", json=make_trace(seed=1, external_id="job-1"), headers=h)
    clash = client.post("/v1/traces", json=make_trace(seed=2, external_id="job-1"), headers=h)
    assert clash.status_code == 409
    assert clash.json()["field"] == "external_id"
    assert first.json()["id"] in clash.json()["detail"]
    assert count_rows(db_url, Trace) == 1


def test_batch_answers_207_with_one_result_per_item_and_stores_the_good_ones(
    client: TestClient, headers: Headers, db_url: str
) -> None:
    h = headers("submitter")
    existing = make_trace(seed=21)
    client.post("/v1/traces", json=existing, headers=h)
    good = make_trace(seed=22, tags=["a", "b", "a"])
    bad_dtype = make_trace(config={"dtype": "bf17"})
    clash = make_trace(seed=23, external_id="x")
    items = [good, bad_dtype, existing, make_trace(seed=24, external_id="x"), clash, good]
    answer = client.post("/v1/traces:batch", json={"traces": items}, headers=h)
    assert answer.status_code == 207, answer.text
    results = answer.json()["results"]
    assert [r["index"] for r in results] == list(range(6))
    assert [r["status"] for r in results] == [201, 422, 200, 201, 409, 200]
    assert results[1]["error"]["field"] == "config.dtype"
    assert results[4]["error"]["field"] == "external_id"
    assert results[5]["id"] == results[0]["id"] and results[5]["created"] is False
    assert count_rows(db_url, Trace) == 3  # existing + good + job x
    # Tags filter rows: duplicates in the list are stored once as filter rows.
    assert count_rows(db_url, TraceTag) == 1 + 2 + 1
    got = client.get(f"/v1/traces/{results[0]['id']}", headers=headers("auditor")).json()
    assert got["tags"] == ["a", "b", "a"]


def test_batch_over_the_limit_is_413_and_stores_nothing(
    client: TestClient, headers: Headers, db_url: str
) -> None:
    trace = make_trace(n_prompt=1, n_output=1, top_k=None, prompt_text=None, output_text=None)
    too_many = {"traces": [trace] * (MAX_BATCH_TRACES + 1)}
    answer = client.post("/v1/traces:batch", json=too_many, headers=headers("submitter"))
    assert answer.status_code == 413
    assert answer.json()["field"] == "traces"
    assert count_rows(db_url, Trace) == 0


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        (b"", 400, "body"),
        (b"{not json", 400, "body"),
        (b"[1, 2]", 422, "traces"),
        (b'{"traces": {}}', 422, "traces"),
        (b'{"traces": [], "extra": 1}', 422, "extra"),
    ],
)
def test_batch_envelope_errors(
    client: TestClient, headers: Headers, body: bytes, status: int, field: str
) -> None:
    answer = client.post("/v1/traces:batch", content=body, headers=headers("submitter"))
    assert answer.status_code == status
    assert answer.json()["field"] == field


def test_empty_batch_is_207_with_no_results(client: TestClient, headers: Headers) -> None:
    answer = client.post("/v1/traces:batch", json={"traces": []}, headers=headers("submitter"))
    assert answer.status_code == 207 and answer.json() == {"results": []}


def test_batch_item_with_nan_logit_names_the_step(client: TestClient, headers: Headers) -> None:
    trace = make_trace(n_output=4)
    body = ('{"traces": [' + _json_with_nan(trace, step=2) + "]}").encode()
    answer = client.post("/v1/traces:batch", content=body, headers=headers("submitter"))
    assert answer.status_code == 207
    (result,) = answer.json()["results"]
    assert result["status"] == 422 and result["error"]["field"] == "top_k.logits[2]"


def test_a_lone_surrogate_sinks_its_item_not_the_batch(
    client: TestClient, headers: Headers, db_url: str
) -> None:
    """`\\ud800` escaped in the JSON (no UTF-8 can carry it raw): that item is a 422 naming the
    field, and the good items around it are stored."""
    import json

    items = [make_trace(seed=31), make_trace(seed=32, tags=["\ud800"]), make_trace(seed=33)]
    body = json.dumps({"traces": items}).encode()  # ensure_ascii writes the escape
    answer = client.post("/v1/traces:batch", content=body, headers=headers("submitter"))
    assert answer.status_code == 207, answer.text
    results = answer.json()["results"]
    assert [r["status"] for r in results] == [201, 422, 201]
    assert results[1]["error"]["field"] == "tags[0]"
    assert count_rows(db_url, Trace) == 2


def _json_with_nan(trace: dict[str, object], step: int) -> str:
    import json

    trace = json.loads(json.dumps(trace))
    trace["top_k"]["logits"][step][1] = float("nan")  # type: ignore[index]
    return json.dumps(trace)  # Python writes the non-standard NaN literal


def test_many_traces_in_one_batch(client: TestClient, headers: Headers, db_url: str) -> None:
    batch = make_batch(120, n_prompt=32, n_output=32)
    answer = client.post("/v1/traces:batch", json={"traces": batch}, headers=headers("admin"))
    assert answer.status_code == 207
    results = answer.json()["results"]
    assert all(r["status"] == 201 for r in results)
    ids = [r["id"] for r in results]
    assert len(set(ids)) == 120 and ids == sorted(ids)  # time-ordered ids in request order
    assert count_rows(db_url, Trace) == 120


def test_token_pieces_are_stored_canonical_and_are_content(
    client: TestClient, headers: Headers
) -> None:
    """Pieces read back as sent, except byte lists that are valid text alone, which are stored
    as that text; they are part of the trace's content (a repeat is the same trace, the same
    tokens without pieces another one), and a trace without pieces reads back null."""
    writer, reader = headers("submitter"), headers("auditor")
    trace = make_trace(n_output=4, seed=77)
    # "é" split over two tokens (two bytes that are not text alone), then "hi" sent as bytes.
    trace["output_token_pieces"] = [" caf", [195], [169], [104, 105]]
    first = client.post("/v1/traces", json=trace, headers=writer).json()
    assert first["created"] is True
    got = client.get(f"/v1/traces/{first['id']}", headers=reader).json()
    assert got["output_token_pieces"] == [" caf", [195], [169], "hi"]

    again = client.post("/v1/traces", json=trace, headers=writer).json()
    assert (again["id"], again["created"]) == (first["id"], False)
    bare = dict(trace)
    del bare["output_token_pieces"]
    other = client.post("/v1/traces", json=bare, headers=writer).json()
    assert other["created"] is True and other["id"] != first["id"]
    got = client.get(f"/v1/traces/{other['id']}", headers=reader).json()
    assert got["output_token_pieces"] is None


@pytest.mark.parametrize("top_k", [2, None])
def test_one_statement_path_stores_what_the_general_path_stores(
    client: TestClient,
    headers: Headers,
    db_url: str,
    is_postgres: bool,
    top_k: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On PostgreSQL a single POST whose configuration is already stored is one statement
    (`repository.insert_one_trace`); the first trace of a configuration, a batch, and SQLite
    take the general path. The same trace sent to two projects, once each way, is stored the
    same: every column of the row but its ids and time, and its tags (once each)."""
    trace = make_trace(seed=31, n_output=4, top_k=top_k, tags=["b", "a", "b"])
    trace["output_token_pieces"] = [" caf", [195], [169], "!"]
    trace["prompt_messages"] = [{"role": "user", "content": "hi"}]
    tried: list[OneTraceInsert | None] = []
    insert_one_trace = repository.insert_one_trace

    def spy(*args: Any) -> OneTraceInsert | None:
        tried.append(outcome := insert_one_trace(*args))
        return outcome

    monkeypatch.setattr(repository, "insert_one_trace", spy)
    general = client.post("/v1/traces", json=trace, headers=headers("submitter", "one"))
    one_statement = client.post("/v1/traces", json=trace, headers=headers("submitter", "two"))
    assert general.status_code == one_statement.status_code == 201
    if is_postgres:  # no configuration yet, then the trace in one statement
        done = [(o.config_id is not None, o.trace is not None) for o in tried if o is not None]
        assert done == [(False, False), (True, True)]
    else:
        assert tried == [None, None]

    with session_scope(db_url) as session:
        rows = {
            row.public_id: row
            for row in session.execute(select(Trace).order_by(Trace.public_id)).scalars()
        }
        tags = {
            public_id: sorted(
                session.execute(select(TraceTag.tag).where(TraceTag.trace_id == row.id)).scalars()
            )
            for public_id, row in rows.items()
        }
        columns = [c.key for c in Trace.__mapper__.column_attrs]
        a, b = rows[general.json()["id"]], rows[one_statement.json()["id"]]
        different = {c for c in columns if _column_value(a, c) != _column_value(b, c)}
        assert different == {"id", "public_id", "project_id"} | (
            {"created_at"} if a.created_at != b.created_at else set()
        )
        assert b.prompt_messages == trace["prompt_messages"] and b.tags == ["b", "a", "b"]
    assert tags == {a.public_id: ["a", "b"], b.public_id: ["a", "b"]}


def _column_value(row: Trace, column: str) -> object:
    value = getattr(row, column)
    return value.tobytes() if isinstance(value, np.ndarray) else value
