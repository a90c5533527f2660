"""API keys: creation, authentication, revocation.

A key reads `ra_<lookup>_<secret>`: `lookup` (12 hex characters, not secret) finds the row,
and the sha256 of the whole key, compared with `hmac.compare_digest`, proves it. The secret has
256 bits of entropy, so a plain sha256 is as good as a slow password hash here, and keeps the
check cheap on every request. The key is shown once, at creation, and never stored. Keys that
passed are kept a few seconds (`PrincipalCache`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from sqlalchemy.orm import Session

from replay_audit.auth import repository
from replay_audit.auth.models import ApiKey, Role
from replay_audit.auth.schemas import ApiKeyRead, Principal
from replay_audit.db.base import utcnow
from replay_audit.db.unit_of_work import after_commit
from replay_audit.exceptions import FieldError, NotAuthenticated, NotFound

KEY_PREFIX: Final = "ra"
#: The project the first admin key of a fresh installation belongs to.
DEFAULT_PROJECT: Final = "default"
_DUMMY_HASH: Final = hashlib.sha256(b"no such key").hexdigest()


@dataclass(frozen=True)
class CreatedKey:
    """A new key: the secret (to show once) and its stored row."""

    key: str
    api_key: ApiKey


def _hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def to_read(api_key: ApiKey) -> ApiKeyRead:
    return ApiKeyRead(
        id=f"key_{api_key.lookup}",  # the lookup part is not secret
        project=api_key.project.name,
        role=Role(api_key.role),
        name=api_key.name,
        created_at=api_key.created_at,
        revoked_at=api_key.revoked_at,
    )


def create_api_key(
    session: Session, project: str, role: Role | str, *, name: str | None = None
) -> CreatedKey:
    """A new key of `role` for `project` (created if need be): the only time the key exists in
    clear outside the caller's hands."""
    try:
        role = Role(role)
    except ValueError:
        raise FieldError(
            f"unknown role {role!r}; one of {', '.join(r.value for r in Role)}", field="role"
        ) from None
    project = project.strip()
    if not 1 <= len(project) <= 100:
        raise FieldError("project name must be 1 to 100 characters", field="project")
    project_row = repository.get_or_create_project(session, project)
    lookup = secrets.token_hex(6)
    key = f"{KEY_PREFIX}_{lookup}_{secrets.token_urlsafe(32)}"
    api_key = ApiKey(
        project_id=project_row.id,
        project=project_row,
        role=role.value,
        name=name,
        lookup=lookup,
        key_sha256=_hash_key(key),
        created_at=utcnow(),
    )
    repository.add_api_key(session, api_key)
    return CreatedKey(key=key, api_key=api_key)


class PrincipalCache:
    """The principals of keys that passed the check in the last `ttl_s` seconds in this process
    (`Settings.api_key_cache_s` says what a revocation then takes), by the sha256 of the whole
    key (the secret never is kept). A request whose key is here needs no query."""

    #: Most keys kept; past it the cache starts over (a deployment has far fewer live keys).
    MAX_KEYS: Final = 10_000

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[Principal, float]] = {}

    def get(self, key_sha256: str) -> Principal | None:
        entry = self._entries.get(key_sha256)
        if entry is None:
            return None
        principal, expires_at = entry
        if self._clock() >= expires_at:
            with self._lock:
                self._entries.pop(key_sha256, None)
            return None
        return principal

    def put(self, key_sha256: str, principal: Principal) -> None:
        if self.ttl_s <= 0:
            return
        with self._lock:
            if len(self._entries) >= self.MAX_KEYS:
                self._entries.clear()
            self._entries[key_sha256] = (principal, self._clock() + self.ttl_s)

    def forget(self, api_key_id: int) -> None:
        """Drop the key with this id (it was revoked)."""
        with self._lock:
            for digest, (principal, _) in list(self._entries.items()):
                if principal.api_key_id == api_key_id:
                    del self._entries[digest]


def cached_principal(cache: PrincipalCache, key: str | None) -> Principal | None:
    """The principal of `key` if it authenticated within the cache's lifetime, else None
    (then `authenticate`). No query."""
    return cache.get(_hash_key(key)) if key else None


def authenticate(
    session: Session, key: str | None, cache: PrincipalCache | None = None
) -> Principal:
    """The principal behind `key`; NotAuthenticated if it is missing, unknown or revoked.
    With `cache`, a key that passes is kept there."""
    if not key:
        raise NotAuthenticated("missing API key (header X-API-Key)")
    prefix, _, rest = key.partition("_")
    lookup, _, secret = rest.partition("_")
    api_key = None
    if prefix == KEY_PREFIX and secret and len(lookup) == 12:
        api_key = repository.find_api_key_by_lookup(session, lookup)
    # Compare even when no row matched, so a miss costs the same as a wrong secret.
    expected = api_key.key_sha256 if api_key is not None else _DUMMY_HASH
    digest = _hash_key(key)
    matches = hmac.compare_digest(expected, digest)
    if api_key is None or not matches or api_key.revoked_at is not None:
        raise NotAuthenticated("invalid or revoked API key")
    principal = principal_of(api_key)
    if cache is not None:
        cache.put(digest, principal)
    return principal


def principal_of(api_key: ApiKey) -> Principal:
    """The caller a key row stands for (checked by the caller: found, matching, not revoked)."""
    return Principal(
        api_key_id=api_key.id,
        project_id=api_key.project_id,
        project=api_key.project.name,
        role=Role(api_key.role),
    )


def list_api_keys(session: Session, project_id: int) -> list[ApiKeyRead]:
    """Every key of the project, revoked ones included, without secrets."""
    return [to_read(k) for k in repository.list_api_keys(session, project_id)]


def revoke_api_key(
    session: Session, project_id: int, key_id: str, cache: PrincipalCache | None = None
) -> ApiKeyRead:
    """Revoke the project's key `key_id` (idempotent); NotFound for another project's key.
    `cache` forgets the key once the revocation is committed."""
    lookup = key_id.removeprefix("key_")
    api_key = repository.find_api_key_by_lookup(session, lookup)
    if api_key is None or api_key.project_id != project_id:
        raise NotFound(f"no API key {key_id!r}", field="key_id")
    if api_key.revoked_at is None:
        api_key.revoked_at = utcnow()
        session.flush()
    if cache is not None:
        api_key_id = api_key.id
        after_commit(session, lambda: cache.forget(api_key_id))
    return to_read(api_key)


def bootstrap_admin_key(session: Session) -> str | None:
    """On a database without any key, create an admin key for the `default` project and return
    it (the caller prints it once); None when keys already exist."""
    if repository.any_api_key_exists(session):
        return None
    return create_api_key(session, DEFAULT_PROJECT, Role.admin, name="bootstrap").key


def find_api_key(session: Session, lookup: str) -> ApiKey | None:
    """The key row whose lookup part is `lookup` (the UI session re-checks it each request)."""
    return repository.find_api_key_by_lookup(session, lookup)
