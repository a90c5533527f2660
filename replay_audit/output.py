"""The bases every response is built from."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from replay_audit.formats import RunStatus
from replay_audit.json_value import JsonObject


class OutputModel(BaseModel):
    """A response model: what the service built, not validated input."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class StoredModel(BaseModel):
    """A response read back from stored JSON: a key an older version wrote and this one no
    longer declares is dropped, so an old run's report still reads."""

    model_config = ConfigDict(frozen=True)


class JobRead(OutputModel):
    """A background job's row: who asked, on which checkpoint, when it ran and how it ended."""

    id: str
    project: str
    status: RunStatus
    model_sha256: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    request: JsonObject
