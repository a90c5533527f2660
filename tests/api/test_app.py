"""The app shell: error rendering, unknown routes, health, OpenAPI."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.testclient import TestClient

from replay_audit.api.app import create_app
from replay_audit.config import Settings


def test_an_unexpected_error_is_a_500_without_a_traceback(settings: Settings) -> None:
    app: FastAPI = create_app(settings)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret internal detail")

    answer = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert answer.status_code == 500
    # Nothing of the cause; the request id, which the server's log lines of it carry.
    assert answer.json() == {
        "error": "InternalError",
        "detail": "internal server error",
        "request_id": answer.headers["X-Request-ID"],
    }
    assert "secret" not in answer.text and "Traceback" not in answer.text


def test_unknown_route_and_wrong_method_use_the_error_shape(client: TestClient) -> None:
    missing = client.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"] == "NotFound"
    wrong = client.put("/v1/traces")
    assert wrong.status_code == 405 and set(wrong.json()) == {"error", "detail"}


def test_healthz(client: TestClient) -> None:
    answer = client.get("/healthz")
    assert answer.status_code == 200 and answer.json()["status"] == "ok"


def test_healthz_is_503_when_the_database_is_unreachable(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(database_url="postgresql+psycopg://nobody@127.0.0.1:1/none")
    answer = client.get("/healthz")
    assert answer.status_code == 503 and answer.json()["status"] == "unavailable"


def test_openapi_documents_the_trace_endpoints_and_bodies(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path, method in [("/v1/traces", "post"), ("/v1/traces:batch", "post"),
                         ("/v1/traces/{trace_id}", "get"), ("/v1/traces", "get")]:
        assert method in paths[path], path
    body = paths["/v1/traces"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/TraceCreate"}
    components = schema["components"]["schemas"]
    assert {"TraceCreate", "TraceBatchCreate", "NumericalConfig", "TopK"} <= set(components)
    assert "prompt_token_ids" in components["TraceCreate"]["properties"]
    assert client.get("/docs").status_code == 200
