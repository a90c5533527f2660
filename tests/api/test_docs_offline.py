"""`/docs` and `/redoc` over HTTP: pages that name no other site, a strict script policy, the
Swagger UI and ReDoc assets served from the installed package (tests/ui/test_docs_browser.py
renders them in Chromium, offline)."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_nothing_from_elsewhere(client: TestClient, page: str) -> None:
    r = client.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert re.findall(r'(?:src|href)="(https?:)?//', r.text) == []  # only this origin
    assert "<script>" not in r.text  # every script is a file (no inline script)
    csp = r.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "connect-src 'self';" in csp
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    for asset in re.findall(r'(?:src|href)="(/docs/assets/[^"]+)"', r.text):
        served = client.get(asset)
        assert served.status_code == 200 and len(served.content) > 100, asset


def test_assets_and_the_absent_oauth2_page(client: TestClient) -> None:
    js = client.get("/docs/assets/swagger-ui-bundle.js")
    assert js.headers["content-type"].startswith("text/javascript")
    assert "SwaggerUIBundle" in js.text[:2000]
    assert client.get("/docs/assets/redoc.standalone.js").status_code == 200
    assert client.get("/docs/assets/../app.py").status_code == 404
    # No OAuth2 here (API keys): FastAPI's redirect page, an inline script, is not served.
    assert client.get("/docs/oauth2-redirect").status_code == 404
