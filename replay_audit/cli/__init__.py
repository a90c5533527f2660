"""The `replay-audit` command. Each module here registers its commands on `app`; heavy imports
(torch, the web app) happen inside the commands so `replay-audit --help` stays fast."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="replay-audit",
    help="Cross-precision replay and audit of LLM inference.",
    no_args_is_help=True,
    add_completion=False,
)

# Registration order is the order in --help.
# ruff: isort: off
from replay_audit.cli import service as _service  # noqa: E402,F401
from replay_audit.cli import engine as _engine  # noqa: E402,F401
from replay_audit.cli import imports as _imports  # noqa: E402,F401
from replay_audit.cli import worker as _worker  # noqa: E402,F401
from replay_audit.cli import demo as _demo  # noqa: E402,F401
from replay_audit.cli import audit as _audit  # noqa: E402,F401
# ruff: isort: on
