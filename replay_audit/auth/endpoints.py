"""HTTP endpoints for API keys: admins of a project manage that project's keys."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from replay_audit.api.deps import DBSession, Principals, require_role
from replay_audit.auth import service
from replay_audit.auth.models import Role
from replay_audit.auth.schemas import ApiKeyCreate, ApiKeyCreated, ApiKeyList, ApiKeyRead, Principal

router = APIRouter(tags=["keys"])

Admin = Annotated[Principal, Depends(require_role(Role.admin))]


@router.post("/v1/keys", status_code=201, response_model=ApiKeyCreated)
def create_key(body: ApiKeyCreate, principal: Admin, session: DBSession) -> ApiKeyCreated:
    """A new key in the caller's project. `key` is in this answer only; store it now."""
    created = service.create_api_key(session, principal.project, body.role, name=body.name)
    return ApiKeyCreated(**service.to_read(created.api_key).model_dump(), key=created.key)


@router.get("/v1/keys", response_model=ApiKeyList)
def list_keys(principal: Admin, session: DBSession) -> ApiKeyList:
    """The project's keys, revoked ones included, without secrets."""
    return ApiKeyList(items=service.list_api_keys(session, principal.project_id))


@router.delete("/v1/keys/{key_id}", response_model=ApiKeyRead)
def revoke_key(key_id: str, principal: Admin, session: DBSession, cache: Principals) -> ApiKeyRead:
    """Revoke a key of the caller's project (idempotent). It stops working at once in the API
    process that answers, and within `REPLAY_AUDIT_API_KEY_CACHE_S` (5 s) in the others."""
    return service.revoke_api_key(session, principal.project_id, key_id, cache)
