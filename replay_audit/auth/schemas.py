"""Keys and the caller's identity, as the API shows them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field

from replay_audit.auth.models import Role
from replay_audit.input import InputModel, Lax


@dataclass(frozen=True)
class Principal:
    """Who is calling: the authenticated key, its project and its role."""

    api_key_id: int
    project_id: int
    project: str
    role: Role


class ApiKeyCreate(InputModel):
    #: Given by value ("auditor"): an enum is a string in JSON.
    role: Annotated[Role, Lax]
    name: str | None = Field(default=None, max_length=200)


class ApiKeyRead(BaseModel):
    """A key without its secret."""

    id: str
    project: str
    role: Role
    name: str | None
    created_at: datetime
    revoked_at: datetime | None


class ApiKeyCreated(ApiKeyRead):
    #: The key itself. Shown this once; only its sha256 is stored.
    key: str


class ApiKeyList(BaseModel):
    items: list[ApiKeyRead]
