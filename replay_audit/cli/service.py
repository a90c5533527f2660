"""Service commands: serve, worker, db, keys."""

from __future__ import annotations

from replay_audit.cli import app  # noqa: F401
