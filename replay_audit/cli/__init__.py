"""The `replay-audit` command. Each module here registers its commands on `app` (`cli/root.py`);
heavy imports (torch, the web app) happen inside the commands so `replay-audit --help` stays
fast. Commands check what they need up front and fail in one line (`cli/database.py`).
"""

from __future__ import annotations

# ruff: isort: off
from replay_audit.cli.root import CommandGroup, app

# Registration order is the order in --help.
from replay_audit.cli import service as _service  # noqa: F401
from replay_audit.cli import engine as _engine  # noqa: F401
from replay_audit.cli import verify as _verify  # noqa: F401
from replay_audit.cli import screen as _screen  # noqa: F401
from replay_audit.cli import imports as _imports  # noqa: F401
from replay_audit.cli import traces as _traces  # noqa: F401
from replay_audit.cli import worker as _worker  # noqa: F401
from replay_audit.cli import demo as _demo  # noqa: F401
from replay_audit.cli import audit as _audit  # noqa: F401
# ruff: isort: on

__all__ = ["CommandGroup", "app"]
