"""A signing secret per webhook, and delivery attempts reduced to a status code and error class.

`audit_schedules.webhook_secret` signs every delivery (HMAC-SHA256, `X-Replay-Audit-Signature`).
It is stored in clear: signing needs the key itself. Schedules that already have a webhook get a
fresh secret nobody has seen; their deliveries are signed from now on, and an admin rotates it
(`PATCH ... {"rotate_webhook_secret": true}`) to learn one.

Alerts kept up to 200 characters of the receiver's error answer, shown to auditors: every
attempt and `last_error` are rewritten to the status code and a fixed error class. That scrub is
not undone by the downgrade (the text is gone on purpose); the downgrade drops the column.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Rows rewritten per round trip.
BATCH = 1000
_HTTP = re.compile(r"^HTTP (\d{3})")
#: The error classes of 0006 (replay_audit.audits.webhook.ERROR_CLASSES, spelled here: a
#: migration does not import the code it migrates for).
_CLASSES = frozenset(
    {
        "refused_destination",
        "dns_error",
        "timeout",
        "connection_refused",
        "tls_error",
        "connection_error",
        "http_3xx",
        "http_4xx",
        "http_5xx",
    }
)


def _error_class(text: str | None) -> tuple[int | None, str | None]:
    """(status code, error class) of an error text written before 0006."""
    if text is None or text in _CLASSES:
        return None, text
    m = _HTTP.match(text)
    if m:
        code = int(m.group(1))
        return code, "http_3xx" if code < 400 else "http_4xx" if code < 500 else "http_5xx"
    if "Timeout" in text:
        return None, "timeout"
    if "refused" in text.lower():
        return None, "connection_refused"
    return None, "connection_error"


def _scrub(log: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for entry in log or []:
        if set(entry) == {"at", "ok", "status_code", "error"}:
            out.append(entry)
            continue
        code, error = _error_class(entry.get("error"))
        ok = bool(entry.get("ok"))
        out.append(
            {"at": entry.get("at"), "ok": ok, "status_code": code, "error": None if ok else error}
        )
    return out


def upgrade() -> None:
    with op.batch_alter_table("audit_schedules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("webhook_secret", sa.String(length=100), nullable=True))

    bind = op.get_bind()
    schedules = sa.table(
        "audit_schedules",
        sa.column("id", sa.Integer()),
        sa.column("webhook_url", sa.String()),
        sa.column("webhook_secret", sa.String()),
    )
    ids = bind.execute(
        sa.select(schedules.c.id).where(schedules.c.webhook_url.is_not(None))
    ).scalars()
    for schedule_id in list(ids):
        bind.execute(
            schedules.update()
            .where(schedules.c.id == schedule_id)
            .values(webhook_secret="whsec_" + secrets.token_urlsafe(32))
        )

    alerts = sa.table(
        "audit_alerts",
        sa.column("id", sa.BigInteger()),
        sa.column("attempt_log", sa.JSON()),
        sa.column("last_error", sa.Text()),
    )
    last = -1
    while True:
        rows = bind.execute(
            sa.select(alerts.c.id, alerts.c.attempt_log, alerts.c.last_error)
            .where(alerts.c.id > last)
            .order_by(alerts.c.id)
            .limit(BATCH)
        ).all()
        if not rows:
            break
        for alert_id, log, last_error in rows:
            bind.execute(
                alerts.update()
                .where(alerts.c.id == alert_id)
                .values(attempt_log=_scrub(log), last_error=_error_class(last_error)[1])
            )
        last = rows[-1][0]


def downgrade() -> None:
    with op.batch_alter_table("audit_schedules", schema=None) as batch_op:
        batch_op.drop_column("webhook_secret")
