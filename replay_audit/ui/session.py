"""The web UI's sign-in session: a signed cookie naming an API key, checked on every request.

Signing in posts an API key (auditor or admin). The cookie holds, signed with HMAC-SHA256 under
the server's session secret:

    {"k": <the key's lookup id, not secret>, "iat": <issued>, "exp": <expires>, "n": <nonce>}

never the key itself. Every request re-reads the key row, so revoking a key ends its sessions at
once; a cookie also expires after `session_max_age_s`. Signing out clears the cookie (a copy
kept by someone who stole it stays valid until it expires or the key is revoked: the stateless
trade-off, documented in docs/ui.md).

SameSite=Lax (no cookie on a cross-site POST) and a per-session CSRF token on every form stop
cross-site requests (the flags: `ui.pages._cookie_scope`).

The secret (`Settings.session_secret`), when unset, is generated once and kept in
`session_secret_file`, created atomically so that the processes of one host agree on it.
Changing it signs everybody out.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sqlalchemy.orm import Session

from replay_audit.auth import service as auth_service
from replay_audit.auth.models import READER_ROLES
from replay_audit.auth.schemas import Principal
from replay_audit.config import Settings
from replay_audit.exceptions import NotAuthenticated, PermissionDenied

COOKIE_NAME: Final = "ra_session"
#: The sign-in form's CSRF cookie (double submit: the form must echo it).
SIGN_IN_COOKIE_NAME: Final = "ra_sign_in"
#: Roles that may browse the UI.
UI_ROLES: Final = frozenset(READER_ROLES)
_VERSION: Final = "v1"

_secret_lock = threading.Lock()
_secrets: dict[tuple[str, Path], bytes] = {}


def _read_or_create_secret(path: Path) -> bytes:
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, value + b"\n")
    finally:
        os.close(fd)
    try:
        # link() fails if another process created the file first: then theirs wins.
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_bytes().strip()


def session_secret(settings: Settings) -> bytes:
    """The key that signs session cookies (see the module docstring); read once per process."""
    if settings.session_secret is not None:
        value = settings.session_secret.get_secret_value().encode()
        if len(value) < 16:
            raise ValueError("REPLAY_AUDIT_SESSION_SECRET must be at least 16 characters")
        return value
    key = ("file", settings.session_secret_file.resolve())
    with _secret_lock:
        if key not in _secrets:
            _secrets[key] = _read_or_create_secret(settings.session_secret_file)
        return _secrets[key]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: bytes, purpose: str, payload: str) -> str:
    # The purpose keeps a signature made for one use (a session) from passing for another.
    return _b64(hmac.new(secret, f"{purpose}:{payload}".encode(), hashlib.sha256).digest())


@dataclass(frozen=True)
class UiSession:
    """A verified session cookie: whose key, when it ends, and its CSRF token."""

    lookup: str
    issued_at: int
    expires_at: int
    nonce: str

    def csrf_token(self, secret: bytes) -> str:
        """The token every state-changing form of this session must carry."""
        return _sign(secret, "csrf", self.nonce)


def issue(secret: bytes, lookup: str, max_age_s: int, now: float | None = None) -> str:
    """A new signed session cookie value for the key with `lookup`."""
    issued = int(now if now is not None else time.time())
    payload = _b64(
        json.dumps(
            {"k": lookup, "iat": issued, "exp": issued + max_age_s, "n": secrets.token_hex(16)},
            separators=(",", ":"),
        ).encode()
    )
    return f"{_VERSION}.{payload}.{_sign(secret, 'session', payload)}"


def verify(secret: bytes, value: str | None, now: float | None = None) -> UiSession | None:
    """The session in a cookie value, or None if it is missing, forged, malformed or expired."""
    if not value:
        return None
    version, _, rest = value.partition(".")
    payload, _, signature = rest.partition(".")
    if version != _VERSION or not payload or not signature:
        return None
    if not hmac.compare_digest(signature, _sign(secret, "session", payload)):
        return None
    try:
        data: Any = json.loads(_unb64(payload))
        session = UiSession(
            lookup=str(data["k"]),
            issued_at=int(data["iat"]),
            expires_at=int(data["exp"]),
            nonce=str(data["n"]),
        )
    except (ValueError, KeyError, TypeError, binascii.Error):
        return None
    if session.expires_at <= (now if now is not None else time.time()):
        return None
    return session


def new_form_token() -> str:
    """A random token for the sign-in form, set as a cookie and echoed by the form (double
    submit): a page of another site cannot read the cookie, so it cannot post a key of its own
    choosing into our sign-in (login CSRF)."""
    return secrets.token_urlsafe(24)


def check_form_token(cookie: str | None, field: str | None) -> bool:
    return bool(cookie) and bool(field) and hmac.compare_digest(str(cookie), str(field))


def check_csrf(secret: bytes, session: UiSession, token: str | None) -> bool:
    return token is not None and hmac.compare_digest(token, session.csrf_token(secret))


def sign_in(session: Session, key: str | None) -> tuple[Principal, str]:
    """Authenticate `key` for the UI: (principal, the key's lookup id). NotAuthenticated for a
    missing, unknown or revoked key; PermissionDenied for a role that may not browse."""
    principal = auth_service.authenticate(session, (key or "").strip() or None)
    if principal.role not in UI_ROLES:
        raise PermissionDenied(
            f"a {principal.role.value} key cannot browse reports; sign in with an auditor "
            "or admin key"
        )
    lookup = key.strip().split("_")[1] if key else ""
    return principal, lookup


def principal_for(session: Session, ui_session: UiSession) -> Principal:
    """The principal of a verified session, re-checked against the key row (revoked keys and
    roles changed since sign-in are refused)."""
    api_key = auth_service.find_api_key(session, ui_session.lookup)
    if api_key is None or api_key.revoked_at is not None:
        raise NotAuthenticated("the key of this session was revoked; sign in again")
    principal = auth_service.principal_of(api_key)
    if principal.role not in UI_ROLES:
        raise PermissionDenied("this key may not browse reports")
    return principal
