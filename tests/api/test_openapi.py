"""The OpenAPI document describes the API the server runs: the error body of every error
answer, and the constraints the server enforces (a client generated from it works)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema_rs
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from replay_audit.audits.schemas import ScheduleReplay
from replay_audit.replays.schemas import ReplayCreate
from replay_audit.screenings.schemas import ScreeningPrompt

Headers = Callable[..., dict[str, str]]

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}


@pytest.fixture
def document(client: TestClient) -> dict[str, Any]:
    schema: dict[str, Any] = client.get("/openapi.json").json()
    return schema


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (path, method, operation)
        for path, item in document["paths"].items()
        for method, operation in item.items()
    ]


def test_every_error_answer_of_every_operation_has_the_error_body(
    document: dict[str, Any],
) -> None:
    components = document["components"]["schemas"]
    assert "HTTPValidationError" not in components and "ValidationError" not in components
    assert set(components["ErrorBody"]["required"]) == {"error", "detail"}
    for path, method, operation in _operations(document):
        if not path.startswith("/v1/"):
            continue
        responses = operation["responses"]
        expected = {"401", "403", "404", "422", "500", "503"}
        if "requestBody" in operation:
            expected |= {"400", "413"}
        assert expected <= set(responses), (method, path)
        for status, response in responses.items():
            if int(status) >= 400:
                schema = response["content"]["application/json"]["schema"]
                assert schema == ERROR_REF, (method, path, status)


@pytest.mark.parametrize(
    ("path", "method", "status"),
    [
        ("/v1/traces", "post", "409"),
        ("/v1/audits/schedules", "post", "409"),
        ("/v1/audits/schedules/{schedule_id}", "patch", "409"),
    ],
)
def test_conflicts_are_documented_where_they_happen(
    document: dict[str, Any], path: str, method: str, status: str
) -> None:
    assert status in document["paths"][path][method]["responses"]


def _parameter(
    document: dict[str, Any], path: str, name: str, method: str = "get"
) -> dict[str, Any]:
    parameters = document["paths"][path][method]["parameters"]
    (parameter,) = [p for p in parameters if p["name"] == name]
    return parameter


@pytest.mark.parametrize("path", ["/v1/traces", "/v1/replays/{run_id}/results", "/v1/replays"])
def test_the_cursor_format_is_in_the_document_and_the_server_keeps_to_it(
    document: dict[str, Any], client: TestClient, headers: Headers, path: str
) -> None:
    """Every cursor the server accepts matches the pattern the document states, so a fuzzer
    never sends a schema-valid cursor the server refuses (issue 20)."""
    schema = _parameter(document, path, "cursor")["schema"]
    (branch,) = [b for b in schema.get("anyOf", [schema]) if b.get("type") == "string"]
    pattern = branch["pattern"]
    for cursor in ["", "garbage", "r:1", "run-1", "tr_" + "U" * 26]:
        assert re.search(pattern, cursor) is None, (pattern, cursor)
        answer = client.get(
            path.replace("{run_id}", "run_x"), params={"cursor": cursor}, headers=headers("admin")
        )
        assert answer.status_code == 422 and answer.json()["field"] == "cursor", answer.text


def test_the_replay_request_states_its_rules(
    document: dict[str, Any], client: TestClient, headers: Headers
) -> None:
    schema = document["components"]["schemas"]["ReplayCreate"]
    # Exactly one of trace_ids and filter...
    (selection,) = [part["oneOf"] for part in schema["allOf"] if "oneOf" in part]
    assert sorted(branch["required"][0] for branch in selection) == ["filter", "trace_ids"]
    # ...and at least one target, or the self-replay.
    targets, pairs, _ = [part["anyOf"] for part in schema["allOf"] if "anyOf" in part]
    assert {"required": ["targets"], "properties": {"targets": {"minItems": 1}}} in targets
    # ...and pairs only with compare: pairwise.
    assert {"required": ["compare"], "properties": {"compare": {"const": "pairwise"}}} in pairs
    admin = headers("admin")
    for body in (
        {"targets": [{"dtype": "fp16"}]},
        {"trace_ids": ["tr_x"], "filter": {}, "targets": [{"dtype": "fp16"}]},
        {"trace_ids": ["tr_x"], "targets": []},
        {"trace_ids": ["tr_x"], "targets": [{"dtype": "fp16"}], "pairs": [[0, 1]]},
    ):
        assert client.post("/v1/replays", json=body, headers=admin).status_code == 422, body


def test_the_import_formats_in_the_document_are_those_http_imports(
    document: dict[str, Any], client: TestClient, headers: Headers
) -> None:
    """lm-eval samples need the checkpoint's tokenizer (the CLI's): not a value of the
    document's `format`, and still refused naming the field (issue 33)."""
    schema = _parameter(document, "/v1/traces:import", "format", "post")["schema"]
    assert schema["enum"] == ["openai", "sglang", "hf"]
    context = {"dtype": "bf16", "model": {"vocab_size": 2, "weights_sha256": "0" * 64}}
    answer = client.post(
        "/v1/traces:import?format=lm-eval",
        json={"context": context, "items": []},
        headers=headers("admin"),
    )
    assert answer.status_code == 422 and answer.json()["field"] == "format", answer.text


def _conforms(document: dict[str, Any], name: str, body: dict[str, Any]) -> bool:
    schema = {"$ref": f"#/components/schemas/{name}"} | {"components": document["components"]}
    return jsonschema_rs.Draft202012Validator(schema).is_valid(body)


@pytest.mark.parametrize("name", ["ReplayCreate", "ScheduleReplay"])
def test_the_pairwise_minimum_is_in_the_document(document: dict[str, Any], name: str) -> None:
    """compare: pairwise needs two targets or more, the self-replay counting (issue 33: a
    pairwise request with one target was schema-valid and a 422)."""
    fp16 = {"dtype": "fp16"}
    base = {"trace_ids": ["tr_x"]} if name == "ReplayCreate" else {}
    model = ReplayCreate if name == "ReplayCreate" else ScheduleReplay
    for extra, valid in [
        ({"compare": "pairwise", "compare_with": "self"}, False),
        ({"compare": "pairwise", "targets": [fp16]}, False),
        ({"compare": "pairwise", "targets": [fp16], "compare_with": "self"}, True),
        ({"compare": "pairwise", "targets": [fp16, fp16]}, True),
        ({"compare_with": "self"}, True),
    ]:
        body = base | extra
        assert _conforms(document, name, body) is valid, body
        try:
            model.model_validate_json(json.dumps(body))
            accepted = True
        except ValidationError:
            accepted = False
        assert accepted is valid, body


def test_a_screening_prompt_is_its_text_or_its_ids_in_the_document(
    document: dict[str, Any],
) -> None:
    """Exactly one of prompt and prompt_token_ids (issue 33: a prompt with neither was
    schema-valid and a 422)."""
    for body, valid in [
        ({}, False),
        ({"id": "p"}, False),
        ({"prompt": None, "prompt_token_ids": None}, False),
        ({"prompt": "hi", "prompt_token_ids": [1]}, False),
        ({"prompt": "hi"}, True),
        ({"prompt": None, "prompt_token_ids": [1]}, True),
    ]:
        assert _conforms(document, "ScreeningPrompt", body) is valid, body
        try:
            ScreeningPrompt.model_validate_json(json.dumps(body))
            accepted = True
        except ValidationError:
            accepted = False
        assert accepted is valid, body
