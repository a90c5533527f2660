"""`replay-audit keys create` and `db upgrade`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from replay_audit.auth.models import ApiKey
from replay_audit.cli import app as cli
from replay_audit.db.unit_of_work import session_scope
from tests.factories import make_trace


@pytest.fixture
def cli_env(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", db_url)
    yield db_url


def test_keys_create_prints_a_working_key_once(cli_env: str, client: TestClient) -> None:
    result = CliRunner().invoke(cli, ["keys", "create", "--project", "cli", "--role", "submitter"])
    assert result.exit_code == 0, result.output
    key = result.output.strip()
    assert key.startswith("ra_") and "\n" not in key
    answer = client.post("/v1/traces", json=make_trace(), headers={"X-API-Key": key})
    assert answer.status_code == 201
    assert client.get("/v1/traces", headers={"X-API-Key": key}).status_code == 403
    with session_scope(cli_env) as session:
        rows = session.execute(select(ApiKey)).scalars().all()
        assert len(rows) == 1, [(r.name, r.project.name, r.role, r.created_at) for r in rows]
        (row,) = rows
        assert row.role == "submitter" and row.project.name == "cli"
        assert key not in (row.key_sha256, row.lookup)


def test_keys_create_refuses_an_unknown_role(cli_env: str) -> None:
    result = CliRunner().invoke(cli, ["keys", "create", "--project", "cli", "--role", "root"])
    assert result.exit_code == 2
    assert "unknown role" in result.output
    with session_scope(cli_env) as session:
        assert session.execute(select(ApiKey)).first() is None


def test_db_upgrade_is_idempotent(cli_env: str) -> None:
    result = CliRunner().invoke(cli, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    assert "database at revision" in result.output
