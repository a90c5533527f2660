"""Engine commands, no server needed: hash-model, generate, replay."""

from __future__ import annotations

from replay_audit.cli import app  # noqa: F401
