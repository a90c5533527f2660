"""`GET /`, where uvicorn's start-up banner points: the UI, not a JSON 404 (issue 20)."""

from __future__ import annotations

from fastapi.testclient import TestClient


def test_root_redirects_to_the_ui(client: TestClient) -> None:
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/ui/"
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/openapi.json" not in page.url.path
    assert "/" not in client.get("/openapi.json").json()["paths"]
