"""Jinja2 for the web UI: autoescaping on for every template (everything a user typed or a
trace contains is escaped unless a chart function built it as `Markup`), undefined variables
are errors, and the response headers every page carries."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from replay_audit.config import PACKAGE_DIR
from replay_audit.screenings.sweep.density import format_tau

if TYPE_CHECKING:  # the web framework only where a page is served, not to render a file
    from starlette.requests import Request
    from starlette.responses import HTMLResponse

TEMPLATE_DIR: Final = PACKAGE_DIR / "api" / "templates"
STATIC_DIR: Final = PACKAGE_DIR / "api" / "static"

#: Same-origin everything, no inline script or style (the charts style through classes), no
#: framing, forms only to ourselves.
SECURITY_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self' data:; script-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    # Pages show a project's data to a signed-in user: keep them out of shared caches.
    "Cache-Control": "no-store",
}


#: What a missing value shows as (an en dash).
NONE: Final = "\u2013"


def pct(value: float | None, digits: int = 1) -> str:
    """0.4123 -> '41.2%'; None -> an en dash."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return NONE
    return f"{value * 100:.{digits}f}%"


def pp(value: float | None, digits: int = 1) -> str:
    """A difference of proportions in signed percentage points."""
    if value is None:
        return NONE
    return f"{value * 100:+.{digits}f} pp"


def num(value: float | int | None, digits: int = 4) -> str:
    """A number for a table: integers as is, floats to `digits` significant digits."""
    if value is None:
        return NONE
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def tau(value: float | None) -> str:
    """A calibrated τ (`density.format_tau`); None -> an en dash."""
    return NONE if value is None else format_tau(value)


def pvalue(value: float | None) -> str:
    if value is None:
        return NONE
    return "< 1e-4" if value < 1e-4 else f"{value:.4f}".rstrip("0").rstrip(".")


def p_is(value: float | None) -> str:
    """'p = 0.0123' or 'p < 1e-4'."""
    if value is None:
        return NONE
    return "p < 1e-4" if value < 1e-4 else f"p = {pvalue(value)}"


def when(value: datetime | None) -> str:
    if value is None:
        return NONE
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)  # SQLite returns naive datetimes; stored in UTC
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def pretty(value: Any) -> str:
    """Indented JSON for a <pre> block (a plain string: the template escapes it)."""
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


def piece(text: str) -> str:
    """A token piece made visible in a run of tokens: line breaks and tabs as symbols, an
    empty piece as ∅ (the text itself keeps them)."""
    if not text:
        return "∅"
    return text.replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATE_DIR),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(pct=pct, pp=pp, num=num, pvalue=pvalue, p_is=p_is, when=when, pretty=pretty)
    env.filters["tau"] = tau
    env.filters["piece"] = piece
    return env


ENV: Final = _environment()


def render(
    request: Request, template: str, context: dict[str, Any], status_code: int = 200
) -> HTMLResponse:
    """Render `template` with `context` plus `base` (the UI's URL prefix) and `request`."""
    from starlette.responses import HTMLResponse

    body = ENV.get_template(template).render(
        base=request.scope.get("root_path", ""), request=request, **context
    )
    return HTMLResponse(body, status_code=status_code, headers=SECURITY_HEADERS)
