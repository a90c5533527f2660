"""GET /v1/traces: filters and cursor pagination, on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.factories import make_config, make_trace

Headers = Callable[..., dict[str, str]]


def _post(client: TestClient, h: dict[str, str], **overrides: Any) -> str:
    answer = client.post("/v1/traces", json=make_trace(**overrides), headers=h)
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def _ids(client: TestClient, h: dict[str, str], **params: Any) -> list[str]:
    answer = client.get("/v1/traces", params=params, headers=h)
    assert answer.status_code == 200, answer.text
    return [item["id"] for item in answer.json()["items"]]


def test_filters(client: TestClient, headers: Headers) -> None:
    h = headers("admin")
    base = _post(client, h)
    other_model = _post(client, h, model={"name": "other-model"})
    other_weights = _post(client, h, model={"weights_sha256": "cd" * 32})
    fp16 = _post(client, h, config={"dtype": "fp16", "lm_head_dtype": None})
    fp8_head = _post(client, h, config={"lm_head_dtype": "fp8_e4m3"})
    sdpa = _post(client, h, config={"attn_kernel": "sdpa"})
    tagged = _post(client, h, tags=["nightly", "eu"])
    external = _post(client, h, external_id="req-42")
    everything = {base, other_model, other_weights, fp16, fp8_head, sdpa, tagged, external}

    assert set(_ids(client, h)) == everything
    assert _ids(client, h, model="other-model") == [other_model]
    assert _ids(client, h, weights_sha256="cd" * 32) == [other_weights]
    assert _ids(client, h, dtype="fp16") == [fp16]
    # lm_head_dtype filters on the effective head dtype: unset means the body dtype.
    assert _ids(client, h, lm_head_dtype="fp16") == [fp16]
    assert _ids(client, h, lm_head_dtype="fp8_e4m3") == [fp8_head]
    assert _ids(client, h, attn_kernel="sdpa") == [sdpa]
    assert _ids(client, h, tag="nightly") == [tagged]
    assert _ids(client, h, tag="absent") == []
    assert _ids(client, h, external_id="req-42") == [external]
    assert set(_ids(client, h, dtype="bf16", attn_kernel="eager")) == everything - {fp16, sdpa}

    config_id = client.get(f"/v1/traces/{sdpa}", headers=h).json()["config_id"]
    assert _ids(client, h, config_id=config_id) == [sdpa]


def test_greedy_filter_and_the_other_surfaces_names(client: TestClient, headers: Headers) -> None:
    h = headers("admin")
    greedy = _post(client, h, tags=["nightly", "eu"])
    sampled = _post(client, h, decoding={"strategy": "sample"}, tags=["nightly"])
    # Every trace is listed unless `greedy` is given (replays and audits select greedy=true).
    assert set(_ids(client, h)) == {greedy, sampled}
    assert _ids(client, h, greedy="true") == [greedy]
    assert _ids(client, h, greedy="false") == [sampled]
    # `model_name` (the replay filter's and the audit selection's name) works beside `model`.
    assert set(_ids(client, h, model_name="tiny-llama")) == {greedy, sampled}
    assert _ids(client, h, model_name="other-model") == []
    assert set(_ids(client, h, model="tiny-llama", model_name="tiny-llama")) == {greedy, sampled}
    # `tag` repeated: traces carrying all of them (the audit selection's `tags`).
    assert _ids(client, h, tag=["nightly", "eu"]) == [greedy]


def test_time_window(client: TestClient, headers: Headers) -> None:
    h = headers("admin")
    early = _post(client, h)
    time.sleep(0.01)
    middle = datetime.now(UTC)
    time.sleep(0.01)
    late = _post(client, h)
    assert _ids(client, h, created_after=middle.isoformat()) == [late]
    assert _ids(client, h, created_before=middle.isoformat()) == [early]
    # A timestamp without a zone means UTC.
    naive = middle.replace(tzinfo=None).isoformat()
    assert _ids(client, h, created_after=naive) == [late]


def test_summary_fields(client: TestClient, headers: Headers) -> None:
    h = headers("admin")
    trace = make_trace(n_prompt=11, n_output=7, tags=["x"], config=make_config(batch_size=8))
    trace_id = client.post("/v1/traces", json=trace, headers=h).json()["id"]
    (item,) = client.get("/v1/traces", headers=h).json()["items"]
    assert item["id"] == trace_id
    assert (item["n_prompt_tokens"], item["n_output_tokens"]) == (11, 7)
    assert item["model"] == trace["model"] and item["tags"] == ["x"]
    assert item["config"]["batch_size"] == 8 and item["config_id"].startswith("cfg_")
    assert "prompt_token_ids" not in item and "top_k" not in item


def test_cursor_pagination_walks_everything_newest_first(
    client: TestClient, headers: Headers
) -> None:
    h = headers("admin")
    batch = {"traces": [make_trace() for _ in range(7)]}
    created = [r["id"] for r in client.post("/v1/traces:batch", json=batch, headers=h).json()[
        "results"]]
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/traces", params=params, headers=h).json()
        seen += [item["id"] for item in page["items"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    assert seen == sorted(created, reverse=True)


def test_exact_page_boundary_has_no_empty_extra_page(client: TestClient, headers: Headers) -> None:
    h = headers("admin")
    client.post("/v1/traces:batch", json={"traces": [make_trace() for _ in range(4)]}, headers=h)
    first = client.get("/v1/traces", params={"limit": 2}, headers=h).json()
    second = client.get(
        "/v1/traces", params={"limit": 2, "cursor": first["next_cursor"]}, headers=h
    ).json()
    assert len(second["items"]) == 2 and second["next_cursor"] is None


def test_model_and_model_name_both_apply(client: TestClient, headers: Headers) -> None:
    """Two filters on the name, not a rule between them (the OpenAPI document cannot state
    one): different names match nothing, the same name matches as either alone."""
    client.post("/v1/traces", json=make_trace(), headers=headers("submitter"))
    name = make_trace()["model"]["name"]
    h = headers("auditor")
    both = client.get("/v1/traces", params={"model": name, "model_name": name}, headers=h)
    assert len(both.json()["items"]) == 1
    other = client.get("/v1/traces", params={"model": name, "model_name": "x"}, headers=h)
    assert other.status_code == 200 and other.json()["items"] == []


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": 501}, "limit"),
        ({"limit": 0}, "limit"),
        ({"cursor": "garbage"}, "cursor"),
        ({"dtype": "bf17"}, "dtype"),
        ({"weights_sha256": "nothex"}, "weights_sha256"),
        ({"created_after": "yesterday"}, "created_after"),
        ({"greedy": "maybe"}, "greedy"),
        ({"cursor": "tr_" + "I" * 26}, "cursor"),  # not Crockford base32, as the pattern says
    ],
)
def test_bad_query_parameters_are_422_naming_them(
    client: TestClient, headers: Headers, params: dict[str, Any], field: str
) -> None:
    answer = client.get("/v1/traces", params=params, headers=headers("auditor"))
    assert answer.status_code == 422
    assert answer.json()["field"] == field


def test_listing_sees_only_the_callers_project(client: TestClient, headers: Headers) -> None:
    mine = _post(client, headers("submitter", "mine"))
    _post(client, headers("submitter", "theirs"))
    assert _ids(client, headers("auditor", "mine")) == [mine]
