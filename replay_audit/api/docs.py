"""The interactive API documentation, served with no network: `/docs` (Swagger UI) and `/redoc`
(ReDoc).

FastAPI's own pages load Swagger UI and ReDoc from a CDN (jsDelivr) and start them with an
inline script, so an offline deployment shows a blank page. Here the assets come from the
`fastapi-offline` package, served under `/docs/assets/` with our start-up script, and the pages
carry a Content-Security-Policy as strict as the assets allow (`DOCS_SECURITY_HEADERS`): styles
allow 'unsafe-inline' because ReDoc (styled-components) writes its CSS into <style> elements and
Swagger UI sets style attributes; ReDoc's search runs in a blob: worker.

There is no OAuth2 redirect page: the API authenticates with an API key header.
"""

from __future__ import annotations

from html import escape
from typing import Final

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.requests import Request
from starlette.responses import HTMLResponse

from replay_audit.config import PACKAGE_DIR

DOCS_URL: Final = "/docs"
REDOC_URL: Final = "/redoc"
ASSETS_URL: Final = "/docs/assets"
#: Our own files of the docs pages (the start-up script); the rest come from fastapi-offline.
OWN_ASSETS: Final = PACKAGE_DIR / "api" / "static" / "docs"

DOCS_SECURITY_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; "
        "worker-src 'self' blob:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
}


def _page(title: str, head: str, body: str) -> HTMLResponse:
    html = (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n{head}</head>\n<body>\n{body}</body>\n</html>\n"
    )
    return HTMLResponse(html, headers=DOCS_SECURITY_HEADERS)


def install_docs(app: FastAPI) -> None:
    """Add `/docs`, `/redoc` and their assets to `app` (created with `docs_url=None`,
    `redoc_url=None`)."""
    assets = StaticFiles(directory=OWN_ASSETS, packages=[("fastapi_offline", "static")])
    app.mount(ASSETS_URL, assets, name="docs-assets")

    def urls(request: Request) -> tuple[str, str]:
        root = str(request.scope.get("root_path", ""))
        return escape(root + ASSETS_URL), escape(root + (app.openapi_url or "/openapi.json"))

    async def swagger_ui(request: Request) -> HTMLResponse:
        assets_url, openapi_url = urls(request)
        return _page(
            f"{app.title} - API docs",
            f'<link rel="icon" href="{assets_url}/favicon.png">\n'
            f'<link rel="stylesheet" href="{assets_url}/swagger-ui.css">\n',
            f'<div id="swagger-ui" data-openapi-url="{openapi_url}"></div>\n'
            f'<script src="{assets_url}/swagger-ui-bundle.js"></script>\n'
            f'<script src="{assets_url}/swagger-init.js"></script>\n',
        )

    async def redoc(request: Request) -> HTMLResponse:
        assets_url, openapi_url = urls(request)
        return _page(
            f"{app.title} - ReDoc",
            f'<link rel="icon" href="{assets_url}/favicon.png">\n',
            f'<redoc spec-url="{openapi_url}"></redoc>\n'
            f'<script src="{assets_url}/redoc.standalone.js"></script>\n',
        )

    app.add_route(DOCS_URL, swagger_ui, include_in_schema=False)
    app.add_route(REDOC_URL, redoc, include_in_schema=False)
