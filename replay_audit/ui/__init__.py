"""The auditors' web UI: server-rendered HTML under `/ui`, read-only, no external resources.

It is its own ASGI app mounted at `/ui` (`mount_ui`), so its errors are HTML pages (a missing
session is a redirect to the sign-in page) while the JSON API keeps its JSON errors, and its
pages stay out of the OpenAPI schema. Importing the package imports no web framework: the
charts and the screening report render where only jinja2 is installed (a GPU machine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI


def mount_ui(app: FastAPI) -> None:
    """Mount the UI app at `/ui` on `app` (`mount.mount_ui`)."""
    from replay_audit.ui.mount import mount_ui as mount

    mount(app)
