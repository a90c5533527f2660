"""Every string a request carries can be stored, and every time it carries is representable:
anything else is a 422 naming the field, on SQLite and PostgreSQL alike, never a 500.

PostgreSQL text cannot hold U+0000 (and no UTF-8 text holds a lone surrogate): such a value is
refused at the edge, in one place per kind of input: `replay_audit.input.InputModel` for request
bodies, `api.deps.refuse_unstorable_parameters` for query and path parameters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel
from pydantic_core import core_schema
from starlette.routing import BaseRoute

Headers = Callable[..., dict[str, str]]

NUL = "a\x00b"
SURROGATE = "a\ud800b"


@pytest.mark.parametrize(
    "param",
    ["model", "model_name", "tag", "external_id", "attn_kernel", "config_id", "cursor"],
)
def test_an_unstorable_query_parameter_is_422_naming_it(
    client: TestClient, headers: Headers, param: str
) -> None:
    # (A lone surrogate cannot arrive here: percent-decoding replaces invalid UTF-8.)
    answer = client.get("/v1/traces", params={param: NUL}, headers=headers("auditor"))
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == param
    assert answer.json()["error"] == "FieldError"


def api_routes(routes: Sequence[BaseRoute]) -> Iterator[APIRoute]:
    """The app's API routes, routers included (`app.routes` holds the included routers)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from api_routes(included.routes)


def _routes_with_path_parameters(app: FastAPI) -> Iterator[tuple[str, str, str]]:
    for route in api_routes(app.routes):
        if route.param_convertors:
            for method in sorted(route.methods - {"HEAD"}):
                first = next(iter(route.param_convertors))
                path = re.sub(r"\{(\w+)\}", "x%00", route.path)
                yield method, path, first


def test_an_unstorable_path_id_is_422_naming_it_on_every_route(
    client: TestClient, headers: Headers
) -> None:
    # Generated from the app's routes: a new route with an id cannot skip the check.
    routes = list(_routes_with_path_parameters(client.app))  # type: ignore[arg-type]
    assert len(routes) >= 12
    for method, path, field in routes:
        answer = client.request(method, path, headers=headers("admin"), json={})
        assert answer.status_code == 422, (method, path, answer.text)
        assert answer.json()["field"] == field, (method, path)


def _schedule(**overrides: Any) -> dict[str, Any]:
    return {"name": "nightly", "replay": {"targets": [{"dtype": "fp16"}]}} | overrides


_REPLAY = {"filter": {"model_name": "m"}, "targets": [{"dtype": "fp16"}]}

BODY_CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("POST", "/v1/replays", {**_REPLAY, "filter": {"model_name": NUL}}, "filter.model_name"),
    ("POST", "/v1/replays", {**_REPLAY, "filter": {"tag": NUL}}, "filter.tag"),
    ("POST", "/v1/replays", {**_REPLAY, "filter": {"config_id": NUL}}, "filter.config_id"),
    ("POST", "/v1/replays", {**_REPLAY, "targets": [{"dtype": "fp16", "label": NUL}]},
     "targets[0].label"),
    ("POST", "/v1/replays", {**_REPLAY, "idempotency_key": NUL}, "idempotency_key"),
    ("POST", "/v1/replays", {"trace_ids": [NUL], "targets": [{"dtype": "fp16"}]},
     "trace_ids[0]"),
    ("POST", "/v1/keys", {"role": "auditor", "name": NUL}, "name"),
    ("POST", "/v1/audits/schedules", _schedule(name=NUL), "name"),
    ("POST", "/v1/audits/schedules", _schedule(selection={"model_name": NUL}),
     "selection.model_name"),
    ("POST", "/v1/audits/schedules", _schedule(selection={"config_id": NUL}),
     "selection.config_id"),
    ("POST", "/v1/audits/schedules",
     _schedule(replay={"targets": [{"dtype": "fp16", "label": SURROGATE}]}),
     "replay.targets[0].label"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), BODY_CASES)
def test_an_unstorable_string_in_a_body_is_422_naming_it(
    client: TestClient, headers: Headers, method: str, path: str, body: dict[str, Any], field: str
) -> None:
    # json.dumps escapes a lone surrogate as `\\ud800`, as JSON clients write it.
    answer = client.request(
        method, path, content=json.dumps(body), headers=headers("admin")
        | {"Content-Type": "application/json"},
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == field


def _request_models(app: FastAPI) -> set[type[BaseModel]]:
    """Every model a request body is validated with, nested ones included."""
    from replay_audit.api.app import raw_body_models

    roots: list[Any] = list(raw_body_models())
    for route in api_routes(app.routes):
        if route.body_field is not None:
            roots.append(route.body_field.field_info.annotation)
    found: set[type[BaseModel]] = set()

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation in found:
                return
            found.add(annotation)
            for field in annotation.model_fields.values():
                visit(field.annotation)
            return
        for argument in getattr(annotation, "__args__", ()):
            visit(argument)

    for root in roots:
        visit(root)
    return found


def _unchecked_strings(schema: Any, checked: bool = False) -> int:
    """The `str` validators in a core schema that our storable-text check does not wrap."""
    from replay_audit.input import refuse_unstorable

    if isinstance(schema, list):
        return sum(_unchecked_strings(item) for item in schema)
    if not isinstance(schema, dict):
        return 0
    if schema.get("type") == "str":
        return 0 if checked else 1
    wraps = (
        schema.get("type") == "function-after"
        and getattr(schema.get("function", {}).get("function"), "__name__", "")
        == refuse_unstorable.__name__
    )
    return sum(
        _unchecked_strings(value, checked=wraps and key == "schema")
        for key, value in schema.items()
        if key not in ("serialization", "metadata")
    )


def test_every_request_model_refuses_unstorable_text(app: FastAPI) -> None:
    from replay_audit.input import InputModel

    models = _request_models(app)
    names = {m.__name__ for m in models}
    assert {"TraceCreate", "ReplayCreate", "ScheduleCreate", "ApiKeyCreate"} <= names
    for model in models:
        assert issubclass(model, InputModel), model
        schema: core_schema.CoreSchema = model.__pydantic_core_schema__
        assert _unchecked_strings(schema) == 0, model


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"created_after": "9999-12-31T23:59:59-01:00"}, "created_after"),
        ({"created_before": "0001-01-01T00:00:00+01:00"}, "created_before"),
    ],
)
def test_a_time_out_of_range_once_in_utc_is_422(
    client: TestClient, headers: Headers, params: dict[str, str], field: str
) -> None:
    answer = client.get("/v1/traces", params=params, headers=headers("auditor"))
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == field


def test_a_filter_time_out_of_range_is_422(client: TestClient, headers: Headers) -> None:
    body = {"filter": {"created_after": "9999-12-31T23:59:59-01:00"},
            "targets": [{"dtype": "fp16"}]}
    answer = client.post("/v1/replays", json=body, headers=headers("admin"))
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "filter.created_after"


def test_a_schedule_runs_listing_time_out_of_range_is_422(
    client: TestClient, headers: Headers
) -> None:
    admin = headers("admin")
    created = client.post("/v1/audits/schedules", json=_schedule(), headers=admin)
    assert created.status_code == 201, created.text
    answer = client.get(
        f"/v1/audits/schedules/{created.json()['id']}/runs",
        params={"before": "9999-12-31T23:59:59-01:00"}, headers=admin,
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "before"


def test_the_ui_refuses_an_unstorable_query_parameter_with_its_error_page(
    client: TestClient,
) -> None:
    answer = client.get("/ui/runs", params={"dtype": "bf16", "from": NUL},
                        follow_redirects=False)
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("text/html")
