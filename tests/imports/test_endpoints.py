"""`POST /v1/traces:import?format=...` over HTTP, on SQLite and PostgreSQL: the batch
endpoint's semantics (207, one result per trace, idempotent by content), its roles, and
errors that name the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.imports.conftest import WEIGHTS, load_fixture

Headers = Callable[..., dict[str, str]]

CONTEXT: dict[str, Any] = {
    "model": {"name": "tiny-llama", "weights_sha256": WEIGHTS, "vocab_size": 32000},
    "dtype": "bf16",
    "logprobs_mode": "raw_logprobs",
    "engine": {"name": "vllm", "version": "0.11.0"},
    "tags": ["gateway"],
}


def _items() -> list[Any]:
    completion = load_fixture("vllm_completion_token_ids.json")
    return [
        {"request": {"temperature": 0}, "response": load_fixture("vllm_chat_token_ids.json")},
        {"request": {"prompt": [1, 2, 3], "temperature": 0.8}, "response": completion},
    ]


def test_import_answers_207_per_trace_and_is_idempotent(
    client: TestClient, headers: Headers
) -> None:
    writer = headers("submitter")
    body = {"context": CONTEXT, "items": _items()}
    first = client.post("/v1/traces:import?format=openai", json=body, headers=writer)
    assert first.status_code == 207, first.text
    results = first.json()["results"]
    assert [(r["index"], r.get("choice"), r["status"]) for r in results] == [
        (0, 0, 201),
        (1, 0, 201),
        (1, 1, 201),
    ]
    again = client.post("/v1/traces:import?format=openai", json=body, headers=writer)
    assert [(r["status"], r["created"], r["id"]) for r in again.json()["results"]] == [
        (200, False, r["id"]) for r in results
    ]
    stored = client.get(f"/v1/traces/{results[0]['id']}", headers=headers("auditor")).json()
    assert stored["external_id"] == "chatcmpl-7f3c2a9e4b1d4c8e9a0b1c2d3e4f5a6b"
    assert stored["config"]["extras"]["top_k_values"] == "raw_logprobs"
    assert stored["config"]["engine"] == {"name": "vllm", "version": "0.11.0"}
    assert stored["tags"] == ["gateway"]
    assert stored["top_k"]["ids"][0] == [278, 263]


def test_a_bad_item_gets_its_own_error_and_the_good_ones_are_stored(
    client: TestClient, headers: Headers
) -> None:
    items = _items()
    del items[0]["response"]["prompt_token_ids"]
    answer = client.post(
        "/v1/traces:import?format=openai",
        json={"context": CONTEXT, "items": items},
        headers=headers("submitter"),
    )
    assert answer.status_code == 207
    bad, *good = answer.json()["results"]
    assert bad["index"] == 0 and bad["status"] == 422
    assert bad["error"]["field"] == "item.response.prompt_token_ids"
    assert "return_token_ids" in bad["error"]["detail"]
    assert [r["status"] for r in good] == [201, 201]


@pytest.mark.parametrize(
    ("url", "body", "status", "field"),
    [
        (
            "/v1/traces:import?format=openai",
            {"context": {**CONTEXT, "dtype": None}, "items": []},
            422,
            "context.dtype",
        ),
        (
            "/v1/traces:import?format=openai",
            {"context": {**CONTEXT, "model": {"vocab_size": 10}}, "items": []},
            422,
            "context.model.weights_sha256",
        ),
        (
            "/v1/traces:import?format=openai",
            {"context": {**CONTEXT, "dtype": "fp64"}, "items": []},
            422,
            "context.dtype",
        ),
        (  # strict over HTTP, as the document says (the CLI's context files are lax)
            "/v1/traces:import?format=openai",
            {"context": {**CONTEXT, "decoding": {"eos_token_ids": ["1"]}}, "items": []},
            422,
            "context.decoding.eos_token_ids[0]",
        ),
        ("/v1/traces:import?format=openai", {"context": CONTEXT}, 422, "items"),
        ("/v1/traces:import?format=lm-eval", {"context": CONTEXT, "items": [{}]}, 422, "format"),
        ("/v1/traces:import?format=xml", {"context": CONTEXT, "items": []}, 422, "format"),
    ],
)
def test_request_level_errors_name_the_field(
    client: TestClient, headers: Headers, url: str, body: Any, status: int, field: str
) -> None:
    answer = client.post(url, json=body, headers=headers("submitter"))
    assert answer.status_code == status, answer.text
    assert answer.json()["field"] == field


def test_malformed_json_is_a_400(client: TestClient, headers: Headers) -> None:
    answer = client.post(
        "/v1/traces:import?format=openai",
        content=b"{",
        headers={**headers("submitter"), "Content-Type": "application/json"},
    )
    assert answer.status_code == 400 and answer.json()["field"] == "body"


@pytest.mark.parametrize(("role", "status"), [("auditor", 403), ("admin", 207), ("submitter", 207)])
def test_roles_as_the_batch_endpoint(
    client: TestClient, headers: Headers, role: str, status: int
) -> None:
    answer = client.post(
        "/v1/traces:import?format=sglang",
        json={"context": CONTEXT, "items": [load_fixture("sglang_generate.json")]},
        headers=headers(role),
    )
    assert answer.status_code == status
    assert client.post("/v1/traces:import?format=sglang", json={"items": []}).status_code == 401


def test_the_endpoint_is_in_the_openapi_schema(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert "/v1/traces:import" in schema["paths"]
    assert "ImportRequest" in schema["components"]["schemas"]


def test_a_top_k_the_server_cannot_keep_is_named_in_the_items_result(
    client: TestClient, headers: Headers
) -> None:
    """The API has no tokenizer: a vLLM chat response whose top-k is keyed by token text (the
    default) is stored with its logged ids and without the top-k, and the answer says why;
    the stored trace says it too, and a response stored with its top-k has no warning."""
    items = [load_fixture("vllm_chat_text_top_k.json"), _items()[0]]
    answer = client.post(
        "/v1/traces:import?format=openai",
        json={"context": CONTEXT, "items": items},
        headers=headers("submitter"),
    )
    assert answer.status_code == 207, answer.text
    text_keyed, with_ids = answer.json()["results"]
    assert text_keyed["status"] == 201
    assert text_keyed["warning"].startswith("the top-k is keyed by token text")
    assert "warning" not in with_ids
    stored = client.get(f"/v1/traces/{text_keyed['id']}", headers=headers("auditor")).json()
    assert stored["top_k"] is None
    assert stored["config"]["extras"]["top_k_source"].startswith("dropped: ")
    assert stored["prompt_messages"] == [{"role": "user", "content": "def _convert_num(node):\n"}]
    assert stored["config"]["batch_size"] is None and stored["config"]["tp_degree"] is None


def test_an_sglang_batch_requests_length_is_not_stored_as_the_batch_that_ran(
    client: TestClient, headers: Headers
) -> None:
    """SGLang batches dynamically: a batch request's list answer (io_struct.GenerateReqInput's
    `text` as a list) gives its length as `request_batch`, the batch size stays unknown."""
    one, two = load_fixture("sglang_generate.json"), load_fixture("sglang_generate.json")
    two["meta_info"]["id"] = "second"
    request = {"input_ids": [[1, 2], [1, 3]], "sampling_params": {"temperature": 0}}
    answer = client.post(
        "/v1/traces:import?format=sglang",
        json={"context": CONTEXT, "items": [{"request": request, "response": [one, two]}]},
        headers=headers("submitter"),
    )
    assert answer.status_code == 207, answer.text
    for result in answer.json()["results"]:
        stored = client.get(f"/v1/traces/{result['id']}", headers=headers("auditor")).json()
        config = stored["config"]
        assert config["batch_size"] is None and config["extras"]["request_batch"] == 2
        assert "batch_size" in config["extras"]["unknown"].split(",")


def test_an_item_of_another_server_is_refused_naming_its_format(
    client: TestClient, headers: Headers
) -> None:
    answer = client.post(
        "/v1/traces:import?format=openai",
        json={"context": CONTEXT, "items": [load_fixture("sglang_generate.json"), _items()[0]]},
        headers=headers("submitter"),
    )
    assert answer.status_code == 207, answer.text
    sglang, openai = answer.json()["results"]
    assert sglang["status"] == 422 and sglang["error"]["field"] == "item.choices"
    assert sglang["error"]["detail"].endswith(
        "(this looks like an SGLang /generate answer: use format=sglang)"
    )
    assert openai["status"] == 201
