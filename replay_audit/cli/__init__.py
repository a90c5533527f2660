"""The `replay-audit` command. Each module here registers its commands on `app`; heavy imports
(torch, the web app) happen inside the commands so `replay-audit --help` stays fast.

Commands check what they need up front and fail in one line (`cli/database.py`); `app` itself is
the last line of defence: a database that goes away mid-command, or a setting that does not
parse, is one line on stderr and exit code 2, not a traceback. It also stops the threads a
command started before the process exits, on Ctrl-C and SIGTERM too (`cli/shutdown.py`).
"""

from __future__ import annotations

import sys
from typing import Any

import typer


def _failure(exc: Exception) -> str | None:
    """The one line for an error a user can fix (None: a bug, which keeps its traceback)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError) and exc.title == "Settings":
        problems = "; ".join(
            f"REPLAY_AUDIT_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        )
        return f"invalid settings: {problems}"
    from replay_audit.cli.database import describe_database_error
    from replay_audit.config import get_settings

    return describe_database_error(exc, get_settings().database_url)


class _App(typer.Typer):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from replay_audit.cli.shutdown import stopping_threads_on_exit

        with stopping_threads_on_exit():  # Ctrl-C and SIGTERM: cli/shutdown.py
            try:
                return super().__call__(*args, **kwargs)
            except Exception as exc:
                message = _failure(exc)
                if message is None:
                    raise
                typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
                sys.exit(2)


app = _App(
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
