"""`serve` says which database it uses and where its key came from (issue 20: `serve` in
another directory silently made a fresh database with a new key)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from replay_audit.cli import app


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    monkeypatch.setenv("REPLAY_AUDIT_SCHEDULER", "off")


def _serve(env: dict[str, Any]) -> str:
    r = CliRunner().invoke(app, ["serve"], env=env)
    assert r.exit_code == 0, r.output
    return r.output


def test_serve_prints_the_default_database_and_a_new_key(
    no_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REPLAY_AUDIT_DATABASE_URL", raising=False)
    out = _serve({"REPLAY_AUDIT_DATABASE_URL": None})
    assert f"database: sqlite:///var/replay-audit.db (file {tmp_path}/var/replay-audit.db)" in out
    assert "from the default; set REPLAY_AUDIT_DATABASE_URL" in out
    assert "First start: created an admin API key" in out
    again = _serve({"REPLAY_AUDIT_DATABASE_URL": None})
    assert "First start" not in again and "already has some" in again
    assert "demo-api-key" not in again
    # After `replay-audit demo` (its key kept in var/demo-api-key): serve points at that key,
    # not at one "printed when it was first served" that nobody saw (issue 33).
    (tmp_path / "var" / "demo-api-key").write_text("ra_demo\n")
    after_demo = _serve({"REPLAY_AUDIT_DATABASE_URL": None})
    assert "admin key (project demo) is kept in var/demo-api-key" in after_demo
    assert "printed when it was first served" not in after_demo


def test_serve_masks_the_password_of_the_url_it_names(no_server: None) -> None:
    from replay_audit.cli.service import _database_line
    from replay_audit.config import Settings

    line = _database_line(Settings(database_url="postgresql+psycopg://u:hunter2@db:5432/x"))
    assert "hunter2" not in line and "postgresql+psycopg://u:***@db:5432/x" in line
    assert line.endswith("from REPLAY_AUDIT_DATABASE_URL")
