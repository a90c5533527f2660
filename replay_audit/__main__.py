"""`python -m replay_audit` is the `replay-audit` command."""

from replay_audit.cli import app

app()
