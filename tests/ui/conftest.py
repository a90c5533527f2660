"""Fixtures for the web UI: the seeded replay run of tests/reports, settings with a session
secret of their own (kept out of the working tree), and a browser-like sign-in."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from replay_audit.config import Settings
from tests.reports.conftest import (  # noqa: F401  (fixtures)
    fake_model_dir,
    logged_trace,
    runner,
    seeded_run,
    worker_env,
)

SESSION_SECRET = "test-session-secret-0123456789abcdef"


@pytest.fixture
def settings(make_settings: Callable[..., Settings], tmp_path: Path) -> Settings:
    return make_settings(
        session_secret=SESSION_SECRET, session_secret_file=tmp_path / "session-secret"
    )


def form_token(html: str) -> str:
    m = re.search(r'name="form_token" value="([^"]+)"', html)
    assert m is not None, html
    return m.group(1)


def csrf_token(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m is not None, html
    return m.group(1)


def sign_in(client: TestClient, key: str, next_url: str | None = None) -> Any:
    """Sign in as a browser would: load the form (its token cookie), post the key."""
    page = client.get("/ui/sign-in", params={"next": next_url} if next_url else None)
    assert page.status_code == 200
    return client.post(
        "/ui/sign-in",
        data={"api_key": key, "form_token": form_token(page.text), "next": next_url or ""},
        follow_redirects=False,
    )


@pytest.fixture
def ui_client(client: TestClient, api_key: Callable[..., str]) -> Callable[..., TestClient]:
    """ui_client(role="auditor", project="acme") -> the test client, signed in."""

    def make(role: str = "auditor", project: str = "acme") -> TestClient:
        client.cookies.clear()
        r = sign_in(client, api_key(role, project))
        assert r.status_code == 303, r.text
        return client

    return make
