"""HTTP details: errors keep the connection open, every error has the documented body, and a
405 lists the methods the path has."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from replay_audit.api.app import create_app
from replay_audit.config import Settings
from tests.api.conftest import ServeApp

Headers = Callable[..., dict[str, str]]

ERROR_KEYS = {"error", "detail", "field"}


@pytest.fixture
def served(settings: Settings, serve: ServeApp) -> Iterator[tuple[str, int]]:
    """The app behind a real uvicorn (keep-alive is the server's business), with a route that
    fails."""
    app: FastAPI = create_app(settings)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("a bug")

    with serve(app) as address:
        yield address


def test_the_connection_stays_open_after_a_500(served: tuple[str, int]) -> None:
    connection = http.client.HTTPConnection(*served, timeout=10)
    try:
        connection.request("GET", "/boom")
        failed = connection.getresponse()
        assert failed.status == 500
        assert json.loads(failed.read()) == {
            "error": "InternalError",
            "detail": "internal server error",
            "request_id": failed.getheader("X-Request-ID"),
        }
        assert (failed.getheader("connection") or "").lower() != "close"
        connection.request("GET", "/healthz")  # the same connection, kept alive
        answer = connection.getresponse()
        assert answer.status == 200 and json.loads(answer.read())["status"] == "ok"
    finally:
        connection.close()


def test_a_chunked_body_over_the_limit_is_413_on_a_fastapi_parsed_endpoint(
    make_client: Callable[..., TestClient], headers: Headers
) -> None:
    client = make_client(max_request_bytes=100)
    body = b'{"role": "auditor", "name": "' + b"x" * 200 + b'"}'
    answer = client.post(
        "/v1/keys",
        content=iter([body[:50], body[50:]]),
        headers=headers("admin") | {"Content-Type": "application/json"},
    )
    assert answer.status_code == 413, answer.text
    assert answer.json() == {
        "error": "PayloadTooLarge",
        "detail": "request body over 100 bytes",
        "field": "body",
    }
    keys = client.get("/v1/keys", headers=headers("admin")).json()["items"]
    assert all(k["role"] == "admin" for k in keys)  # the auditor key was not created


@pytest.mark.parametrize("path", ["/v1/keys", "/v1/replays", "/v1/traces", "/v1/traces:batch"])
def test_invalid_utf8_is_400_with_the_documented_body(
    client: TestClient, headers: Headers, path: str
) -> None:
    answer = client.post(
        path,
        content=b'{"role": "\xff\xfe"}',
        headers=headers("admin") | {"Content-Type": "application/json"},
    )
    assert answer.status_code == 400, answer.text
    assert set(answer.json()) == ERROR_KEYS
    assert answer.json()["error"] == "BadRequest" and answer.json()["field"] == "body"


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/v1/traces", {"GET", "POST"}),
        ("OPTIONS", "/v1/traces", {"GET", "POST"}),
        ("DELETE", "/v1/traces:batch", {"POST"}),
        ("OPTIONS", "/v1/keys", {"GET", "POST"}),
        ("PUT", "/v1/audits/schedules/as_x", {"GET", "PATCH", "DELETE"}),
        ("OPTIONS", "/v1/audits/schedules/as_x/runs", {"GET", "POST"}),
    ],
)
def test_a_wrong_method_is_405_listing_every_method_of_the_path(
    client: TestClient, headers: Headers, method: str, path: str, allowed: set[str]
) -> None:
    answer = client.request(method, path, headers=headers("admin"))
    assert answer.status_code == 405, answer.text
    assert set(answer.json()) == {"error", "detail"}
    assert answer.json()["error"] == "MethodNotAllowed"
    advertised = {m.strip() for m in answer.headers["allow"].split(",")}
    assert advertised == allowed | ({"HEAD"} if "GET" in allowed else set())


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/ui/sign-in"])
def test_head_answers_as_get_without_a_body(served: tuple[str, int], path: str) -> None:
    """Load balancers and uptime checks probe with HEAD: the probes and the sign-in page
    answer it as GET does (status and headers), with no body, on one kept-alive connection."""
    connection = http.client.HTTPConnection(*served, timeout=10)
    try:
        connection.request("GET", path)
        got = connection.getresponse()
        body = got.read()
        connection.request("HEAD", path)
        head = connection.getresponse()
        assert head.read() == b"" and body
        assert head.status == got.status == 200
        assert head.getheader("content-type") == got.getheader("content-type")
    finally:
        connection.close()


def test_every_answer_says_not_to_sniff_its_type(client: TestClient, headers: Headers) -> None:
    """JSON, errors, pages, the exposition: each answer's type is the one it names."""
    answers = [
        client.get("/v1/traces", headers=headers("admin")),
        client.get("/v1/traces/tr_unknown", headers=headers("admin")),
        client.get("/v1/traces"),
        client.get("/ui/sign-in"),
        client.get("/healthz"),
    ]
    assert [a.status_code for a in answers] == [200, 404, 401, 200, 200]
    assert all(a.headers["x-content-type-options"] == "nosniff" for a in answers)
